//! Registered tensor buffers and the segment layout that splits them into packets.
//!
//! A tensor is a preallocated, 64-byte aligned byte buffer with an element type. Before a
//! transfer it is cut into consecutive segments of `segment_payload` bytes (the largest whole
//! number of elements that fits the MTU after all headers); only the last segment may be
//! short. Because segments never split an element, every packet can be placed on its own, in
//! any order (DLCP §3.2.3), and a lost packet costs whole elements only.

use std::fmt;

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::wire;

/// Alignment of every tensor buffer: a cache line, so element views of every dtype are aligned
/// and copies into the buffer start on a line.
pub const TENSOR_ALIGN: usize = 64;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Opaque bytes (element size 1).
    Raw,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn elem_size(self) -> usize {
        match self {
            DType::Raw => 1,
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Code used on the control channel.
    pub const fn code(self) -> u8 {
        match self {
            DType::Raw => 0,
            DType::F32 => 1,
            DType::F16 => 2,
            DType::Bf16 => 3,
        }
    }

    /// Inverse of [`DType::code`].
    pub const fn from_code(code: u8) -> Option<DType> {
        match code {
            0 => Some(DType::Raw),
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::Bf16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::Raw => "raw",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "raw" | "u8" | "bytes" => Ok(DType::Raw),
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::Bf16),
            other => Err(format!(
                "unknown dtype {other:?} (expected raw, f32, f16 or bf16)"
            )),
        }
    }
}

/// One cache line of storage; `Vec<Line>` gives an aligned buffer without unsafe code.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; TENSOR_ALIGN]);

/// A preallocated, aligned tensor buffer.
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    len_bytes: usize,
    lines: Vec<Line>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("len_bytes", &self.len_bytes)
            .finish_non_exhaustive()
    }
}

impl Tensor {
    /// A zero-filled tensor of `elems` elements.
    pub fn zeros(dtype: DType, elems: usize) -> Tensor {
        let len_bytes = elems.saturating_mul(dtype.elem_size());
        let lines = vec![Line([0; TENSOR_ALIGN]); len_bytes.div_ceil(TENSOR_ALIGN)];
        Tensor {
            dtype,
            len_bytes,
            lines,
        }
    }

    /// A zero-filled tensor of `bytes` bytes; `bytes` must be a whole number of elements.
    pub fn zeros_bytes(dtype: DType, bytes: usize) -> Option<Tensor> {
        (bytes % dtype.elem_size() == 0).then(|| Tensor::zeros(dtype, bytes / dtype.elem_size()))
    }

    /// A tensor holding a copy of `values`.
    pub fn from_f32(values: &[f32]) -> Tensor {
        let mut t = Tensor::zeros(DType::F32, values.len());
        t.as_bytes_mut()
            .copy_from_slice(bytemuck::cast_slice(values));
        t
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.len_bytes / self.dtype.elem_size()
    }

    /// The buffer as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<Line, u8>(&self.lines)[..self.len_bytes]
    }

    /// The buffer as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<Line, u8>(&mut self.lines)[..self.len_bytes]
    }

    /// The elements, when the dtype is f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        (self.dtype == DType::F32).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements, mutably, when the dtype is f32.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        (self.dtype == DType::F32).then(|| bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// The elements, when the dtype is f16.
    pub fn as_f16(&self) -> Option<&[f16]> {
        (self.dtype == DType::F16).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements, mutably, when the dtype is f16.
    pub fn as_f16_mut(&mut self) -> Option<&mut [f16]> {
        (self.dtype == DType::F16).then(|| bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// The elements, when the dtype is bf16.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        (self.dtype == DType::Bf16).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements, mutably, when the dtype is bf16.
    pub fn as_bf16_mut(&mut self) -> Option<&mut [bf16]> {
        (self.dtype == DType::Bf16).then(|| bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// Fill with a deterministic pseudo-random pattern (for tests, demos and benches).
    pub fn fill_pattern(&mut self, seed: u64) {
        let mut rng = fastrand::Rng::with_seed(seed);
        if let Some(v) = self.as_f32_mut() {
            v.iter_mut().for_each(|x| *x = rng.f32() * 2.0 - 1.0);
        } else if let Some(v) = self.as_f16_mut() {
            v.iter_mut()
                .for_each(|x| *x = f16::from_f32(rng.f32() * 2.0 - 1.0));
        } else if let Some(v) = self.as_bf16_mut() {
            v.iter_mut()
                .for_each(|x| *x = bf16::from_f32(rng.f32() * 2.0 - 1.0));
        } else {
            rng.fill(self.as_bytes_mut());
        }
    }
}

/// Bytes of headers below the segment payload, for the IP version in use.
pub const fn overhead(ipv6: bool) -> usize {
    (if ipv6 { 40 } else { 20 }) + 8 + wire::header::HEADER_LEN
}

/// Largest segment payload for `mtu` (IP MTU, as on the interface), in whole elements.
/// `None` if not even one element fits.
pub fn max_segment_payload(mtu: usize, ipv6: bool, dtype: DType) -> Option<usize> {
    let room = mtu.checked_sub(overhead(ipv6))?.min(u16::MAX as usize);
    let payload = room / dtype.elem_size() * dtype.elem_size();
    (payload > 0).then_some(payload)
}

/// Largest segment payload for `mtu` that also fits a datapath carrying datagrams of at
/// most `max_datagram` bytes (gradwire header included), in whole elements.
pub fn segment_payload_for(
    mtu: usize,
    ipv6: bool,
    dtype: DType,
    max_datagram: usize,
) -> Option<usize> {
    let room = max_segment_payload(mtu, ipv6, dtype)?
        .min(max_datagram.saturating_sub(wire::header::HEADER_LEN));
    let payload = room / dtype.elem_size() * dtype.elem_size();
    (payload > 0).then_some(payload)
}

/// Why a data packet could not be placed into the active tensor. Cheap to return per packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum PlaceError {
    /// The packet is for a job this receiver has no flow for.
    #[error("unknown job")]
    UnknownJob,
    /// The packet is for a tensor this receiver has no flow for.
    #[error("unknown tensor")]
    UnknownTensor,
    /// The packet belongs to another round (iteration) of the tensor, e.g. a late packet.
    #[error("stale round")]
    StaleRound,
    /// offset + length falls outside the registered tensor.
    #[error("offset+length outside the tensor")]
    OutOfBounds,
    /// The length is not a whole number of elements.
    #[error("length not a multiple of the element size")]
    NotElementMultiple,
    /// The length exceeds what the MTU allows.
    #[error("payload longer than the MTU allows")]
    TooLong,
    /// The payload does not coincide with one segment of the announced layout.
    #[error("payload is not exactly one segment")]
    Misaligned,
}

/// How a tensor of a given size is cut into segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLayout {
    size_bytes: u64,
    elem_size: u32,
    segment_payload: u32,
    count: u32,
}

/// Why a segment layout is impossible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Segment payload is zero or not a whole number of elements.
    #[error("segment payload {payload} B is not a positive multiple of the element size {elem} B")]
    BadPayload {
        /// Requested payload.
        payload: u64,
        /// Element size.
        elem: u32,
    },
    /// Size is not a whole number of elements.
    #[error("tensor size {size} B is not a multiple of the element size {elem} B")]
    BadSize {
        /// Tensor size.
        size: u64,
        /// Element size.
        elem: u32,
    },
    /// More than 2^32-1 segments.
    #[error("tensor of {size} B needs more than 2^32-1 segments of {payload} B")]
    TooManySegments {
        /// Tensor size.
        size: u64,
        /// Segment payload.
        payload: u64,
    },
}

impl SegmentLayout {
    /// Layout for `size_bytes` of elements of `elem_size` bytes in segments of `segment_payload`.
    pub fn new(
        size_bytes: u64,
        elem_size: usize,
        segment_payload: usize,
    ) -> Result<SegmentLayout, LayoutError> {
        let elem = elem_size as u32;
        let payload = segment_payload as u64;
        if elem == 0 || payload == 0 || payload % elem as u64 != 0 || payload > u16::MAX as u64 {
            return Err(LayoutError::BadPayload { payload, elem });
        }
        if size_bytes % elem as u64 != 0 {
            return Err(LayoutError::BadSize {
                size: size_bytes,
                elem,
            });
        }
        let count = u32::try_from(size_bytes.div_ceil(payload)).map_err(|_| {
            LayoutError::TooManySegments {
                size: size_bytes,
                payload,
            }
        })?;
        Ok(SegmentLayout {
            size_bytes,
            elem_size: elem,
            segment_payload: payload as u32,
            count,
        })
    }

    /// Layout for `tensor` under `mtu`.
    pub fn for_tensor(
        tensor: &Tensor,
        mtu: usize,
        ipv6: bool,
    ) -> Result<SegmentLayout, LayoutError> {
        let elem = tensor.dtype().elem_size();
        let payload = max_segment_payload(mtu, ipv6, tensor.dtype()).unwrap_or(0);
        SegmentLayout::new(tensor.len_bytes() as u64, elem, payload)
    }

    /// Tensor size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Bytes in every full segment.
    pub fn segment_payload(&self) -> usize {
        self.segment_payload as usize
    }

    /// Element size in bytes.
    pub fn elem_size(&self) -> usize {
        self.elem_size as usize
    }

    /// Number of segments.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Byte range `(offset, len)` of segment `index`; `None` past the end.
    #[inline]
    pub fn segment(&self, index: u32) -> Option<(u64, usize)> {
        if index >= self.count {
            return None;
        }
        let offset = index as u64 * self.segment_payload as u64;
        let len = (self.size_bytes - offset).min(self.segment_payload as u64) as usize;
        Some((offset, len))
    }

    /// Check that a received `(offset, len)` is exactly one segment and return its index.
    ///
    /// This is the check that keeps a remote peer from writing outside a tensor: only
    /// `(offset, len)` pairs that this layout itself produces are accepted.
    #[inline]
    pub fn locate(&self, offset: u64, len: usize) -> Result<u32, PlaceError> {
        if len > self.segment_payload as usize {
            return Err(PlaceError::TooLong);
        }
        let end = offset
            .checked_add(len as u64)
            .ok_or(PlaceError::OutOfBounds)?;
        if end > self.size_bytes {
            return Err(PlaceError::OutOfBounds);
        }
        if len % self.elem_size as usize != 0 {
            return Err(PlaceError::NotElementMultiple);
        }
        if offset % self.segment_payload as u64 != 0 {
            return Err(PlaceError::Misaligned);
        }
        let index = (offset / self.segment_payload as u64) as u32;
        match self.segment(index) {
            Some((_, expect)) if expect == len => Ok(index),
            _ => Err(PlaceError::Misaligned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_sized() {
        for (dtype, elems) in [
            (DType::F32, 1000),
            (DType::F16, 3),
            (DType::Bf16, 0),
            (DType::Raw, 65),
        ] {
            let t = Tensor::zeros(dtype, elems);
            assert_eq!(t.len_bytes(), elems * dtype.elem_size());
            assert_eq!(t.as_bytes().as_ptr() as usize % TENSOR_ALIGN, 0);
            assert!(t.as_bytes().iter().all(|&b| b == 0));
        }
        let t = Tensor::from_f32(&[1.0, -2.5]);
        assert_eq!(t.as_f32(), Some(&[1.0f32, -2.5][..]));
        assert!(t.as_f16().is_none());
        assert!(Tensor::zeros_bytes(DType::F32, 6).is_none());
    }

    #[test]
    fn payload_fits_mtu_in_whole_elements() {
        assert_eq!(max_segment_payload(1500, false, DType::F32), Some(1440));
        assert_eq!(max_segment_payload(1500, true, DType::F32), Some(1420));
        assert_eq!(max_segment_payload(1500, true, DType::F16), Some(1420));
        assert_eq!(max_segment_payload(1500, false, DType::Raw), Some(1440));
        // 9000-byte jumbo frames.
        assert_eq!(max_segment_payload(9000, false, DType::F32), Some(8940));
        // An odd room rounds down to whole elements.
        assert_eq!(max_segment_payload(66, false, DType::F32), Some(4));
        assert_eq!(max_segment_payload(63, false, DType::F32), None);
        assert_eq!(max_segment_payload(60, false, DType::Raw), None);
        // A datapath cap that is not a whole number of elements rounds down too.
        assert_eq!(
            segment_payload_for(1500, false, DType::F32, 32 + 1002),
            Some(1000)
        );
        assert_eq!(
            segment_payload_for(1500, false, DType::F32, 1472),
            Some(1440)
        );
        assert_eq!(segment_payload_for(1500, false, DType::F32, 35), None);
    }

    #[test]
    fn segments_cover_tensor_exactly_for_odd_sizes() {
        for dtype in [DType::Raw, DType::F32, DType::F16, DType::Bf16] {
            for elems in [0usize, 1, 359, 360, 361, 1000, 12345] {
                let t = Tensor::zeros(dtype, elems);
                let l = SegmentLayout::for_tensor(&t, 1500, false).unwrap();
                let mut next = 0u64;
                for i in 0..l.count() {
                    let (off, len) = l.segment(i).unwrap();
                    assert_eq!(off, next);
                    assert!(len > 0 && len <= l.segment_payload());
                    assert_eq!(
                        len % dtype.elem_size(),
                        0,
                        "no element straddles two packets"
                    );
                    if i + 1 < l.count() {
                        assert_eq!(len, l.segment_payload());
                    }
                    assert_eq!(l.locate(off, len), Ok(i));
                    next += len as u64;
                }
                assert_eq!(next, t.len_bytes() as u64);
                assert!(l.segment(l.count()).is_none());
            }
        }
    }

    #[test]
    fn locate_rejects_each_bad_case_distinctly() {
        // 1000 f32 = 4000 B, segments of 1440 B: [0,1440) [1440,2880) [2880,4000)
        let l = SegmentLayout::new(4000, 4, 1440).unwrap();
        assert_eq!(l.count(), 3);
        assert_eq!(l.locate(2880, 1120), Ok(2));
        assert_eq!(l.locate(0, 1444), Err(PlaceError::TooLong));
        assert_eq!(l.locate(3000, 1120), Err(PlaceError::OutOfBounds));
        assert_eq!(l.locate(u64::MAX - 3, 8), Err(PlaceError::OutOfBounds));
        assert_eq!(l.locate(0, 1439), Err(PlaceError::NotElementMultiple));
        assert_eq!(l.locate(4, 1436), Err(PlaceError::Misaligned));
        assert_eq!(l.locate(0, 1436), Err(PlaceError::Misaligned));
        assert_eq!(l.locate(2880, 1000), Err(PlaceError::Misaligned));
    }

    #[test]
    fn layout_rejects_impossible_shapes() {
        assert!(matches!(
            SegmentLayout::new(10, 4, 8),
            Err(LayoutError::BadSize { .. })
        ));
        assert!(matches!(
            SegmentLayout::new(8, 4, 6),
            Err(LayoutError::BadPayload { .. })
        ));
        assert!(matches!(
            SegmentLayout::new(8, 4, 0),
            Err(LayoutError::BadPayload { .. })
        ));
        assert!(matches!(
            SegmentLayout::new(u64::MAX / 2, 1, 1),
            Err(LayoutError::TooManySegments { .. })
        ));
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [DType::Raw, DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(d.to_string().parse::<DType>(), Ok(d));
        }
        assert_eq!(DType::from_code(9), None);
    }
}
