//! Element types a gradient buffer may hold: f32, and f16/bf16 for compressed exchanges.
//!
//! On the lowest floor, beside the raw layer that hands buffers of them to MPI: the exchange
//! strategies, the planning code and the benches all speak in them.
//!
//! Half-precision values travel over MPI as 16-bit words (MPI has no standard half type) and
//! are summed in f32, one rounding per addition.

use bytemuck::Pod;
use half::{bf16, f16};
use mpi::traits::Equivalence;
use tch::Kind;

pub trait Element: Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static {
    /// The libtorch element type (tch's own mapping gives bf16 the wrong kind, so it is not used).
    const KIND: Kind;
    /// How the value travels over MPI: the same bits, as a type MPI knows.
    type Wire: Equivalence + Pod;
    const NAME: &'static str;

    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    fn as_wire_mut(s: &mut [Self]) -> &mut [Self::Wire] {
        bytemuck::cast_slice_mut(s)
    }
}

impl Element for f32 {
    const KIND: Kind = Kind::Float;
    type Wire = f32;
    const NAME: &'static str = "float";
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const KIND: Kind = Kind::Half;
    type Wire = u16;
    const NAME: &'static str = "half";
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const KIND: Kind = Kind::BFloat16;
    type Wire = u16;
    const NAME: &'static str = "bfloat16";
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// `acc[i] += src[i]`, summed in f32.
#[inline]
pub fn accumulate<E: Element>(acc: &mut [E], src: &[E]) {
    debug_assert_eq!(acc.len(), src.len());
    for (a, s) in acc.iter_mut().zip(src) {
        *a = E::from_f32(a.to_f32() + s.to_f32());
    }
}

/// `acc[i] = (acc[i] + src[i]) * scale`, summed in f32: the last reduction step of a mean.
#[inline]
pub fn accumulate_scaled<E: Element>(acc: &mut [E], src: &[E], scale: f32) {
    debug_assert_eq!(acc.len(), src.len());
    for (a, s) in acc.iter_mut().zip(src) {
        *a = E::from_f32((a.to_f32() + s.to_f32()) * scale);
    }
}

/// `out[i] = own[i] + arrived[i]`, summed in f32 with the operands in `accumulate`'s order, so
/// that a sum written elsewhere has the same bits as one added in place.
#[inline]
pub fn sum_into<E: Element>(out: &mut [E], own: &[E], arrived: &[E]) {
    debug_assert!(out.len() == own.len() && own.len() == arrived.len());
    for ((o, a), s) in out.iter_mut().zip(own).zip(arrived) {
        *o = E::from_f32(a.to_f32() + s.to_f32());
    }
}

/// `acc[i] += src[i]` (then `*= scale`, for a mean), also written to `copy[i]`: one pass for a
/// sum that is needed in two places.
#[inline]
pub fn accumulate_and_copy<E: Element>(acc: &mut [E], src: &[E], copy: &mut [E], scale: Option<f32>) {
    debug_assert!(acc.len() == src.len() && src.len() == copy.len());
    match scale {
        Some(f) => {
            for ((a, s), c) in acc.iter_mut().zip(src).zip(copy.iter_mut()) {
                *a = E::from_f32((a.to_f32() + s.to_f32()) * f);
                *c = *a;
            }
        }
        None => {
            for ((a, s), c) in acc.iter_mut().zip(src).zip(copy.iter_mut()) {
                *a = E::from_f32(a.to_f32() + s.to_f32());
                *c = *a;
            }
        }
    }
}

/// The dtypes a benchmark or a compressed exchange can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub fn kind(self) -> Kind {
        match self {
            Dtype::F32 => Kind::Float,
            Dtype::F16 => Kind::Half,
            Dtype::Bf16 => Kind::BFloat16,
        }
    }
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => f32::NAME,
            Dtype::F16 => f16::NAME,
            Dtype::Bf16 => bf16::NAME,
        }
    }
    pub fn of_kind(kind: Kind) -> Option<Dtype> {
        match kind {
            Kind::Float => Some(Dtype::F32),
            Kind::Half => Some(Dtype::F16),
            Kind::BFloat16 => Some(Dtype::Bf16),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_sum_in_f32() {
        // 2048 + 1 is not representable in f16 (spacing 2 there), the f32 sum rounds to even.
        let mut acc = [f16::from_f32(2048.0), f16::from_f32(0.5)];
        accumulate(&mut acc, &[f16::from_f32(1.0), f16::from_f32(0.25)]);
        assert_eq!(acc[0].to_f32(), 2048.0);
        assert_eq!(acc[1].to_f32(), 0.75);
        let mut b = [bf16::from_f32(1.0)];
        accumulate_scaled(&mut b, &[bf16::from_f32(3.0)], 0.5);
        assert_eq!(b[0].to_f32(), 2.0);
    }

    #[test]
    fn sums_written_elsewhere_have_the_bits_of_sums_in_place() {
        let own: Vec<f32> = (0..37).map(|i| 0.1 * i as f32 + 1e7).collect();
        let arrived: Vec<f32> = (0..37).map(|i| 0.3 - 0.07 * i as f32).collect();
        let mut in_place = own.clone();
        accumulate(&mut in_place, &arrived);
        let mut out = vec![0.0f32; 37];
        sum_into(&mut out, &own, &arrived);
        assert_eq!(out, in_place);
        for scale in [None, Some(0.25f32)] {
            let (mut acc, mut copy) = (own.clone(), vec![0.0f32; 37]);
            accumulate_and_copy(&mut acc, &arrived, &mut copy, scale);
            let mut expected = own.clone();
            match scale {
                Some(f) => accumulate_scaled(&mut expected, &arrived, f),
                None => accumulate(&mut expected, &arrived),
            }
            assert_eq!((&acc, &copy), (&expected, &expected), "scale {scale:?}");
        }
    }

    #[test]
    fn wire_views_keep_the_bits() {
        let v = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        let mut v2 = v;
        let w = f16::as_wire_mut(&mut v2);
        assert_eq!(w, &[v[0].to_bits(), v[1].to_bits()]);
    }
}
