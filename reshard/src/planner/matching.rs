//! Which source tensor feeds each destination tensor, in which dtypes and
//! along which [`Route`], and when two tensor pairs are placed alike (the
//! key under which the reshard's templates and the baseline's recipes are
//! shared).

use crate::dtype::{can_convert, DType};
use crate::fingerprint::Fnv64;
use crate::layout::{Layout, TensorLayout};
use crate::plan::PlanError;
use crate::quant;
use crate::route::{self, QuantizeAt, Route};
use std::hash::Hash;

/// How a destination tensor is matched: its source tensor and the dtypes
/// values leave and arrive in; `None` for one never moved.
pub(crate) type Matched = Option<(u32, DType, DType)>;

/// Matches destination tensors to source tensors and checks shapes and
/// dtypes; returns, per destination tensor, the source index and the
/// dtypes values leave and arrive in, and its [`Route`]. A block-scaled
/// tensor is quantized where `at` says if its source allows
/// ([`route::source_quantizable`]): at the source, codes travel (e4m3 to
/// e4m3) and its scale tensor is matched to the same source tensor (f32 to
/// f32); at the destination, its unquantized blocks arrive in
/// [`quant::staged_dtype`] and its scale tensor gets `None`: it is written
/// by the destination's quantization, never moved.
pub(crate) fn match_tensors(src: &Layout, dst: &Layout, at: QuantizeAt) -> Result<(Vec<Matched>, Vec<Route>), PlanError> {
    let mut routes = vec![Route::Plain; dst.tensors().len()];
    let mut matched = dst
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if dst.scale_for(i as u32).is_some() {
                return Ok(None);
            }
            // Names are unique: layouts listing tensors in the same order
            // need no lookup.
            let si = match src.tensors().get(i) {
                Some(s) if s.name == t.name => i as u32,
                _ => src.tensor_index(&t.name).ok_or_else(|| PlanError::MissingTensor { tensor: t.name.clone() })?,
            };
            let s = &src.tensors()[si as usize];
            if s.shape != t.shape {
                return Err(PlanError::ShapeMismatch { tensor: t.name.clone(), src: s.shape.clone(), dst: t.shape.clone() });
            }
            if s.scale.is_some() {
                return Err(PlanError::ScaledSource { tensor: t.name.clone() });
            }
            if let Some((_, block)) = dst.scale_of(i as u32) {
                let staged = quant::staged_dtype(s.dtype).ok_or(PlanError::Quantize { tensor: t.name.clone(), from: s.dtype })?;
                if at == QuantizeAt::Source && route::source_quantizable(src, si, block) {
                    routes[i] = Route::QuantizedAtSource;
                    return Ok(Some((si, DType::F8E4M3, DType::F8E4M3)));
                }
                routes[i] = Route::QuantizedAtDestination;
                return Ok(Some((si, s.dtype, staged)));
            }
            if !can_convert(s.dtype, t.dtype) {
                return Err(PlanError::Conversion { tensor: t.name.clone(), from: s.dtype, to: t.dtype });
            }
            Ok(Some((si, s.dtype, t.dtype)))
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    // The scales of tensors quantized at the source travel from there too.
    for t in 0..matched.len() as u32 {
        if let (Route::QuantizedAtSource, Some((s, _))) = (routes[t as usize], dst.scale_of(t)) {
            let si = matched[t as usize].map(|m| m.0);
            matched[s as usize] = si.map(|si| (si, DType::F32, DType::F32));
            routes[s as usize] = Route::ScalesFromSource;
        }
    }
    Ok((matched, routes))
}

/// The dtypes per destination tensor of [`match_tensors`]'s result, as
/// [`Plan`](crate::Plan) keeps them (a scale tensor, never moved, as its own f32).
pub(crate) fn wire_pairs(matched: &[Matched]) -> Vec<(DType, DType)> {
    matched.iter().map(|m| m.map_or((DType::F32, DType::F32), |(_, s, d)| (s, d))).collect()
}

/// A hash over what makes a (source, destination) tensor pair placed alike
/// with another: the destination shape and both placements' geometry
/// (storage aside: own or fused buffers and offsets play no part in
/// which ranks exchange which blocks). Callers add what else they need to
/// agree (the dtypes) and compare with [`placed_alike`].
pub(crate) fn placement_key(st: &TensorLayout, dt: &TensorLayout) -> Fnv64 {
    let mut h = Fnv64::default();
    dt.shape.hash(&mut h);
    st.placement.hash_geometry(&mut h);
    dt.placement.hash_geometry(&mut h);
    h
}

/// Whether the pair (`rs`, `rd`) is placed like (`st`, `dt`) (see
/// [`placement_key`]).
pub(crate) fn placed_alike(st: &TensorLayout, dt: &TensorLayout, rs: &TensorLayout, rd: &TensorLayout) -> bool {
    rd.shape == dt.shape && rs.placement.same_geometry(&st.placement) && rd.placement.same_geometry(&dt.placement)
}

/// Whether destination tensors `a` and `b` are block-scaled alike: both
/// unscaled, or in blocks of one shape with their scales placed alike
/// (what, beside [`placed_alike`], decides where a plan delivers them).
pub(crate) fn scaled_alike(dst: &Layout, a: u32, b: u32) -> bool {
    match (dst.scale_of(a), dst.scale_of(b)) {
        (None, None) => true,
        (Some((sa, ba)), Some((sb, bb))) => {
            ba == bb && dst.tensors()[sa as usize].placement.same_geometry(&dst.tensors()[sb as usize].placement)
        }
        _ => false,
    }
}

/// Adds to `h` what [`scaled_alike`] compares.
pub(crate) fn hash_scale(dst: &Layout, t: u32, h: &mut Fnv64) {
    match dst.scale_of(t) {
        None => 0u8.hash(h),
        Some((s, block)) => {
            1u8.hash(h);
            block.hash(h);
            dst.tensors()[s as usize].placement.hash_geometry(h);
        }
    }
}
