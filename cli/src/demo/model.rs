//! The bandit and the policy: the seeded RNG ([`SplitMix`]), the task
//! (contexts and their target actions), the initial weights, and the
//! tensor-parallel forward pass whose partial logits ranks sum.

use super::{DemoError, ACTIONS, AT_B1, AT_B2, AT_W1, AT_W2, CONTEXTS, DIM, HIDDEN, HS, PARAMS_LEN};

/// A tiny deterministic RNG (splitmix64).
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator for `seed` (`stream` separates independent streams).
    pub fn new(seed: u64, stream: u64) -> SplitMix {
        let mut r = SplitMix(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[-a, a)`.
    pub fn symmetric(&mut self, a: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) * a as f64) as f32
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n
    }
}

/// The bandit: contexts and their target actions.
#[derive(Clone, Debug)]
pub(super) struct Task {
    /// `CONTEXTS × DIM`, row-major.
    pub(super) contexts: Vec<f32>,
    pub(super) targets: Vec<usize>,
}

impl Task {
    pub(super) fn new(seed: u64) -> Task {
        let mut rng = SplitMix::new(seed, 1);
        let contexts = (0..CONTEXTS * DIM).map(|_| rng.symmetric(1.0)).collect();
        let targets = (0..CONTEXTS).map(|_| rng.below(ACTIONS)).collect();
        Task { contexts, targets }
    }

    pub(super) fn context(&self, k: usize) -> &[f32] {
        &self.contexts[k * DIM..(k + 1) * DIM]
    }
}

/// Full (unsharded) initial weights.
pub(super) struct InitWeights {
    pub(super) w1: Vec<f32>,
    pub(super) b1: Vec<f32>,
    pub(super) w2: Vec<f32>,
    pub(super) b2: Vec<f32>,
}

impl InitWeights {
    pub(super) fn new(seed: u64) -> InitWeights {
        let mut rng = SplitMix::new(seed, 2);
        let bound = (6.0 / DIM as f32).sqrt();
        let w1 = (0..HIDDEN * DIM).map(|_| rng.symmetric(bound)).collect();
        let b1 = (0..HIDDEN).map(|_| rng.symmetric(0.1)).collect();
        // Small output weights: the initial policy is close to uniform.
        let w2 = (0..ACTIONS * HIDDEN).map(|_| rng.symmetric(0.01)).collect();
        let b2 = vec![0.0; ACTIONS];
        InitWeights { w1, b1, w2, b2 }
    }

    /// Training rank `t`'s fused buffer.
    pub(super) fn fused(&self, t: usize) -> Vec<f32> {
        let mut p = vec![0.0; PARAMS_LEN];
        p[AT_W1..AT_B1].copy_from_slice(&self.w1[t * HS * DIM..(t + 1) * HS * DIM]);
        p[AT_B1..AT_W2].copy_from_slice(&self.b1[t * HS..(t + 1) * HS]);
        for a in 0..ACTIONS {
            p[AT_W2 + a * HS..AT_W2 + (a + 1) * HS].copy_from_slice(&self.w2[a * HIDDEN + t * HS..a * HIDDEN + (t + 1) * HS]);
        }
        p[AT_B2..].copy_from_slice(&self.b2);
        p
    }
}

/// Partial logits of one tensor-parallel rank for `xs` (`n × DIM`):
/// `W2_t relu(W1_t x + b1_t)` over its `hs` hidden units, plus `b2` if given.
/// `w2` is `[ACTIONS, hs]` row-major. Also returns the pre-activations.
pub(super) fn partial_forward(xs: &[f32], w1: &[f32], b1: &[f32], w2: &[f32], b2: Option<&[f32]>, hs: usize) -> (Vec<f32>, Vec<f32>) {
    let n = xs.len() / DIM;
    let mut z = vec![0.0f32; n * hs];
    let mut logits = vec![0.0f32; n * ACTIONS];
    for i in 0..n {
        let x = &xs[i * DIM..(i + 1) * DIM];
        let zi = &mut z[i * hs..(i + 1) * hs];
        for j in 0..hs {
            zi[j] = b1[j] + w1[j * DIM..(j + 1) * DIM].iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
        }
        for a in 0..ACTIONS {
            let row = &w2[a * hs..(a + 1) * hs];
            let mut s = b2.map_or(0.0, |b| b[a]);
            for j in 0..hs {
                s += row[j] * zi[j].max(0.0);
            }
            logits[i * ACTIONS + a] = s;
        }
    }
    (logits, z)
}

pub(super) fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

pub(super) fn add_into(acc: &mut [f32], part: &[f32]) -> Result<(), DemoError> {
    if acc.len() != part.len() {
        return Err(DemoError::Inconsistent(format!("partial logits of {} values, expected {}", part.len(), acc.len())));
    }
    acc.iter_mut().zip(part).for_each(|(a, p)| *a += p);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::layout::layouts;
    use crate::demo::trainer::split_params;
    use crate::demo::TRAIN_TP;

    /// The sharded forward pass equals the unsharded one, and the fused
    /// buffers hold exactly the layout's shards.
    #[test]
    fn sharded_forward_matches_full() {
        let init = InitWeights::new(5);
        let task = Task::new(5);
        let xs = task.contexts[..4 * DIM].to_vec();
        let (full, _) = partial_forward(&xs, &init.w1, &init.b1, &init.w2, Some(&init.b2), HIDDEN);
        let mut sum = vec![0.0f32; full.len()];
        for t in 0..TRAIN_TP {
            let p = init.fused(t);
            let (w1, b1, w2, b2) = split_params(&p);
            let (part, _) = partial_forward(&xs, w1, b1, w2, (t == 0).then_some(b2), HS);
            add_into(&mut sum, &part).unwrap();
        }
        for (a, b) in full.iter().zip(&sum) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let (src, dst) = layouts().unwrap();
        assert_eq!(src.ranks(), 4);
        assert_eq!(dst.ranks(), 4);
    }
}
