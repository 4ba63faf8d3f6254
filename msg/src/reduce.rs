//! Element-wise arithmetic on little-endian tensors, for receives that reduce as they place
//! (a reduce-scatter step adds each arriving segment into the accumulator: one pass over the
//! bytes, no staging copy).

use gradwire_proto::tensor::DType;

/// How a reducing receive combines an arriving element with the one it lands on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Combine {
    /// `dst + src`.
    #[default]
    Sum,
    /// The smaller (a NaN on either side gives NaN, as torch's `minimum`).
    Min,
    /// The larger (NaN as for `Min`).
    Max,
    /// `dst * src`.
    Product,
}

impl Combine {
    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Combine::Sum => a + b,
            Combine::Min if a.is_nan() || b.is_nan() => f32::NAN,
            Combine::Min => a.min(b),
            Combine::Max if a.is_nan() || b.is_nan() => f32::NAN,
            Combine::Max => a.max(b),
            Combine::Product => a * b,
        }
    }
}

/// `dst = combine(dst, src)` element-wise in `dtype` (`Raw` bytes are only summed, wrapping).
/// Lengths must be equal and a whole number of elements, and `Raw` takes only `Sum`;
/// otherwise nothing is done and `false` is returned.
pub fn combine_into(combine: Combine, dtype: DType, dst: &mut [u8], src: &[u8]) -> bool {
    if combine == Combine::Sum {
        return add_into(dtype, dst, src);
    }
    if dst.len() != src.len() || dst.len() % dtype.elem_size() != 0 {
        return false;
    }
    match dtype {
        DType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                let a = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                let b = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&combine.apply(a, b).to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = half::f16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&half::f16::from_f32(combine.apply(a, b)).to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = half::bf16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&half::bf16::from_f32(combine.apply(a, b)).to_le_bytes());
            }
        }
        DType::Raw => return false,
    }
    true
}

/// `dst += src` element-wise in `dtype` (`Raw`: byte-wise wrapping add). Lengths must be equal
/// and a whole number of elements; otherwise nothing is done and `false` is returned.
pub fn add_into(dtype: DType, dst: &mut [u8], src: &[u8]) -> bool {
    if dst.len() != src.len() || dst.len() % dtype.elem_size() != 0 {
        return false;
    }
    match dtype {
        DType::F32 => {
            // Plain loops over fixed-size chunks: the compiler vectorises them (criterion
            // bench `reduce`: 45 GiB/s, the same as an add over aligned f32 slices).
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                let a = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                let b = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&(a + b).to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = half::f16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&half::f16::from_f32(a + b).to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let a = half::bf16::from_le_bytes([d[0], d[1]]).to_f32();
                let b = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&half::bf16::from_f32(a + b).to_le_bytes());
            }
        }
        DType::Raw => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.wrapping_add(*s);
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_each_dtype_and_refuses_mismatched_lengths() {
        let mut a: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b: Vec<u8> = [0.5f32, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(add_into(DType::F32, &mut a, &b));
        assert_eq!(
            a,
            [2.0f32, 2.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
        );
        let mut h = half::f16::from_f32(1.0).to_le_bytes().to_vec();
        assert!(add_into(
            DType::F16,
            &mut h,
            &half::f16::from_f32(2.0).to_le_bytes()
        ));
        assert_eq!(h, half::f16::from_f32(3.0).to_le_bytes());
        let mut bf = half::bf16::from_f32(1.0).to_le_bytes().to_vec();
        assert!(add_into(
            DType::Bf16,
            &mut bf,
            &half::bf16::from_f32(0.5).to_le_bytes()
        ));
        assert_eq!(bf, half::bf16::from_f32(1.5).to_le_bytes());
        assert!(!add_into(DType::F32, &mut [0u8; 4], &[0u8; 8]));
        assert!(!add_into(DType::F32, &mut [0u8; 6], &[0u8; 6]));
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn min_max_product_per_dtype_and_raw_only_sums() {
        let a = f32s(&[1.0, -3.0, f32::NAN, 2.0]);
        let b = f32s(&[2.0, -4.0, 0.0, 2.0]);
        for (c, want) in [
            (Combine::Min, [1.0, -4.0, f32::NAN, 2.0]),
            (Combine::Max, [2.0, -3.0, f32::NAN, 2.0]),
            (Combine::Product, [2.0, 12.0, f32::NAN, 4.0]),
            (Combine::Sum, [3.0, -7.0, f32::NAN, 4.0]),
        ] {
            let mut d = a.clone();
            assert!(combine_into(c, DType::F32, &mut d, &b));
            let got: Vec<f32> = d
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect();
            for (g, w) in got.iter().zip(want) {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{c:?}"
                );
            }
        }
        let mut h = half::f16::from_f32(3.0).to_le_bytes().to_vec();
        assert!(combine_into(
            Combine::Min,
            DType::F16,
            &mut h,
            &half::f16::from_f32(-1.0).to_le_bytes()
        ));
        assert_eq!(h, half::f16::from_f32(-1.0).to_le_bytes());
        let mut bf = half::bf16::from_f32(3.0).to_le_bytes().to_vec();
        assert!(combine_into(
            Combine::Product,
            DType::Bf16,
            &mut bf,
            &half::bf16::from_f32(0.5).to_le_bytes()
        ));
        assert_eq!(bf, half::bf16::from_f32(1.5).to_le_bytes());
        assert!(!combine_into(Combine::Max, DType::Raw, &mut [1u8], &[2u8]));
        assert!(!combine_into(
            Combine::Max,
            DType::F32,
            &mut [0u8; 4],
            &[0u8; 8]
        ));
    }
}
