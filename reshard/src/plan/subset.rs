//! Tensor subsets: the destination tensors a subset refit plans (LoRA
//! adapters, one stage's weights), by name.

use super::PlanError;
use crate::layout::Layout;

/// Names of destination tensors, sorted and without duplicates.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorSubset(std::sync::Arc<[String]>);

impl TensorSubset {
    /// The subset of these names (any order, duplicates dropped).
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> TensorSubset {
        let mut v: Vec<String> = names.into_iter().map(Into::into).collect();
        v.sort_unstable();
        v.dedup();
        TensorSubset(v.into())
    }

    /// The names, sorted.
    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// Which of `dst`'s tensors are in the subset, by index (a block-scaled
    /// tensor and its scale tensor both, if either is named); an error
    /// names the first name `dst` does not have, or an empty subset.
    pub fn mask(&self, dst: &Layout) -> Result<Vec<bool>, PlanError> {
        if self.0.is_empty() {
            return Err(PlanError::EmptySubset);
        }
        let mut mask = vec![false; dst.tensors().len()];
        for name in self.0.iter() {
            let i = dst.tensor_index(name).ok_or_else(|| PlanError::UnknownSubsetTensor { tensor: name.clone() })?;
            mask[i as usize] = true;
        }
        // A block-scaled tensor and its scale are written together.
        for t in 0..mask.len() as u32 {
            if let Some((s, _)) = dst.scale_of(t) {
                let both = mask[t as usize] || mask[s as usize];
                mask[t as usize] = both;
                mask[s as usize] = both;
            }
        }
        Ok(mask)
    }
}
