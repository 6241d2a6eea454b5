//! Replicas of a layout: the layout of a group that is `n` copies of one
//! replica's layout side by side (data-parallel inference instances), for
//! groups that grow and shrink by whole replicas.

use super::{Layout, LayoutError, MeshDim, MeshPlacement, Placement, ShardSpec, TensorLayout};

impl Layout {
    /// The layout of `n` replicas of this one: replica `r` holds on ranks
    /// `r * k .. (r + 1) * k` (`k` this layout's ranks) exactly what rank
    /// `j` holds here on rank `r * k + j`, stored alike. A mesh placement
    /// gains a leading replicated mesh dimension of size `n`; explicit
    /// shards are listed once per replica, replica by replica. Nodes keep
    /// this layout's size, so replicas of whole nodes stay on whole nodes.
    /// One replica is this layout.
    ///
    /// A rank's buffers are the same in every replica (their sizes, types
    /// and order; a shard's own buffer is named by its index in the list,
    /// which differs from replica to replica). The result depends only on
    /// this layout and `n`, so two groups that differ only in which
    /// replicas they have get the same layout (and the same plans).
    pub fn replicated(&self, n: u32) -> Result<Layout, LayoutError> {
        let k = self.ranks;
        let field = |problem: String| LayoutError::Field { field: "replicas".into(), problem };
        match n {
            0 => return Err(field("must be at least 1".into())),
            1 => return Ok(self.clone()),
            _ => {}
        }
        let ranks = k
            .checked_mul(n)
            .filter(|&r| r <= super::MAX_RANKS)
            .ok_or_else(|| field(format!("{n} replicas of {k} ranks exceed the {} ranks a group may have", super::MAX_RANKS)))?;
        let tensors = self.replicated_tensors(n).collect();
        Layout::new(ranks, Some(self.ranks_per_node), tensors)
    }

    /// The tensors of [`replicated`](Self::replicated)`(n)`, as it lists
    /// them (`n` at least 1), without building or checking the layout.
    pub(crate) fn replicated_tensors(&self, n: u32) -> impl Iterator<Item = TensorLayout> + '_ {
        let k = self.ranks;
        self.tensors.iter().map(move |t| TensorLayout {
            placement: match &t.placement {
                Placement::Mesh(m) => Placement::Mesh(MeshPlacement {
                    shape: std::iter::once(n).chain(m.shape.iter().copied()).collect(),
                    ranks: (0..n).flat_map(|r| m.ranks.iter().map(move |&j| r * k + j)).collect(),
                    dims: std::iter::once(MeshDim::Replicate).chain(m.dims.iter().copied()).collect(),
                    storage: m.storage.clone(),
                }),
                Placement::Shards(shards) => Placement::Shards(
                    (0..n).flat_map(|r| shards.iter().map(move |s| ShardSpec { rank: r * k + s.rank, ..s.clone() })).collect(),
                ),
            },
            ..t.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::layout::{Layout, MeshDim, MeshPlacement, Placement, Region, ShardSpec, Storage, TensorLayout};
    use crate::DType;

    /// Two ranks: a TP2 row-sharded weight in a fused buffer, a replicated
    /// bias in its own, and an explicitly sharded flat tensor.
    fn one() -> Layout {
        let mesh = |dims, storage| Placement::Mesh(MeshPlacement { shape: vec![2], ranks: vec![0, 1], dims, storage });
        let t =
            |name: &str, shape: Vec<u64>, placement| TensorLayout { name: name.into(), dtype: DType::F32, shape, placement, scale: None };
        Layout::new(
            2,
            Some(2),
            vec![
                t("w", vec![4, 3], mesh(vec![MeshDim::Shard(0)], Storage::InBuffer { buffer: "fused".into(), at: 2 })),
                t("b", vec![3], mesh(vec![MeshDim::Replicate], Storage::Own)),
                t(
                    "flat",
                    vec![10],
                    Placement::Shards(
                        [(0, 0, 6), (1, 6, 4)]
                            .into_iter()
                            .map(|(rank, start, len)| ShardSpec { rank, region: Region::Flat { start, len }, storage: Storage::Own })
                            .collect(),
                    ),
                ),
            ],
        )
        .unwrap()
    }

    #[test]
    fn every_replica_holds_what_the_one_layout_holds() {
        let one = one();
        let three = one.replicated(3).unwrap();
        assert_eq!(three.ranks(), 6);
        assert_eq!(three.ranks_per_node(), 2);
        for t in 0..one.tensors().len() as u32 {
            for r in 0..3 {
                for j in 0..2 {
                    let want: Vec<_> = one.rank_holdings(t, j).into_iter().map(|(b, l)| (b, l.at)).collect();
                    let got: Vec<_> = three.rank_holdings(t, r * 2 + j).into_iter().map(|(b, l)| (b, l.at)).collect();
                    assert_eq!(got, want, "tensor {t}, replica {r}, rank {j}");
                }
            }
        }
        for r in 0..3 {
            for j in 0..2 {
                let shape = |l: &Layout, rank| -> Vec<_> { l.rank_buffers(rank).into_iter().map(|b| (b.dtype, b.elems)).collect() };
                assert_eq!(shape(&three, r * 2 + j), shape(&one, j));
            }
        }
        // One replica is the layout itself; the count alone decides the rest.
        assert_eq!(one.replicated(1).unwrap().fingerprint(), one.fingerprint());
        assert_eq!(one.replicated(3).unwrap().fingerprint(), three.fingerprint());
        assert_ne!(one.replicated(2).unwrap().fingerprint(), three.fingerprint());
    }

    #[test]
    fn no_replicas_or_too_many_is_an_error_naming_the_field() {
        let one = one();
        for n in [0, u32::MAX] {
            let e = one.replicated(n).unwrap_err().to_string();
            assert!(e.contains("replicas"), "{e}");
        }
    }
}
