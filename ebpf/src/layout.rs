//! Map layouts shared with the BPF program, derived from `src/bpf/gradwire.h` at build time.
//!
//! Nothing here is written by hand: [`types`] is generated from the BTF clang emits for the
//! header, and the `GW_*` constants from its enumerator lines (see `build.rs`). Map values are
//! encoded and decoded field by field at `offset_of!` positions of the generated structs, so
//! no `unsafe` transmute is needed and a layout change in C cannot silently desynchronise the
//! two sides: renaming or retyping a field fails to compile here, and the asserts below pin
//! the sizes this crate's encoders were written for.

use std::mem::{offset_of, size_of};

#[allow(
    dead_code,
    non_camel_case_types,
    non_snake_case,
    unused_imports,
    missing_docs,
    clippy::all,
    rust_2018_idioms
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/gradwire_types.rs"));
}
#[allow(dead_code, clippy::all)]
mod consts {
    include!(concat!(env!("OUT_DIR"), "/gradwire_consts.rs"));
}

pub(crate) use consts::*;
pub(crate) use generated::types;
use types::{gw_addr_key, gw_allow_value, gw_config, gw_counter, gw_fault_prob};

// The encoders below write every field; these pin the sizes they were written for (no hidden
// padding that would reach the kernel uninitialised or unhashed).
const _: () = assert!(size_of::<gw_config>() == 12 + 2 * GW_MAX_PORTS as usize);
const _: () = assert!(size_of::<gw_addr_key>() == 20);
const _: () = assert!(size_of::<gw_allow_value>() == 4);
const _: () = assert!(size_of::<gw_fault_prob>() == 4);
const _: () = assert!(size_of::<gw_counter>() == 16);
const _: () = assert!(GW_CNT_MAX == 8 && GW_NUM_CLASSES == 4 * GW_NUM_DSCP);

fn put_u16(buf: &mut [u8], off: usize, v: u16) {
    buf[off..off + 2].copy_from_slice(&v.to_ne_bytes());
}

fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

fn get_u64(buf: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    u64::from_ne_bytes(b)
}

/// `struct gw_config` bytes. `ports` must hold at most `GW_MAX_PORTS` entries (validated by
/// the caller); unused slots stay 0.
pub(crate) fn encode_config(
    enabled: bool,
    allowlist_enabled: bool,
    switch_port: bool,
    ports: &[u16],
) -> Vec<u8> {
    let mut buf = vec![0u8; size_of::<gw_config>()];
    put_u32(
        &mut buf,
        offset_of!(gw_config, switch_port),
        u32::from(switch_port),
    );
    put_u32(&mut buf, offset_of!(gw_config, enabled), u32::from(enabled));
    put_u32(
        &mut buf,
        offset_of!(gw_config, allowlist_enabled),
        u32::from(allowlist_enabled),
    );
    let base = offset_of!(gw_config, ports);
    for (i, p) in ports.iter().take(GW_MAX_PORTS as usize).enumerate() {
        put_u16(&mut buf, base + 2 * i, *p);
    }
    buf
}

/// `struct gw_addr_key` bytes: family 4 with the address in `addr[0..4]` or family 6.
pub(crate) fn encode_addr_key(addr: std::net::IpAddr) -> Vec<u8> {
    let mut buf = vec![0u8; size_of::<gw_addr_key>()];
    let base = offset_of!(gw_addr_key, addr);
    match addr {
        std::net::IpAddr::V4(a) => {
            put_u32(&mut buf, offset_of!(gw_addr_key, family), GW_FAMILY_IPV4);
            buf[base..base + 4].copy_from_slice(&a.octets());
        }
        std::net::IpAddr::V6(a) => {
            put_u32(&mut buf, offset_of!(gw_addr_key, family), GW_FAMILY_IPV6);
            buf[base..base + 16].copy_from_slice(&a.octets());
        }
    }
    buf
}

/// `struct gw_allow_value` bytes (presence is what matters).
pub(crate) fn encode_allow_value() -> Vec<u8> {
    vec![0u8; size_of::<gw_allow_value>()]
}

/// `struct gw_fault_prob` bytes.
pub(crate) fn encode_fault(prob: u32) -> Vec<u8> {
    let mut buf = vec![0u8; size_of::<gw_fault_prob>()];
    put_u32(&mut buf, offset_of!(gw_fault_prob, prob), prob);
    buf
}

/// `(packets, bytes)` of one CPU's `struct gw_counter`.
pub(crate) fn decode_counter(buf: &[u8]) -> (u64, u64) {
    (
        get_u64(buf, offset_of!(gw_counter, packets)),
        get_u64(buf, offset_of!(gw_counter, bytes)),
    )
}

pub(crate) const CONFIG_SIZE: usize = size_of::<gw_config>();
pub(crate) const ADDR_KEY_SIZE: usize = size_of::<gw_addr_key>();
pub(crate) const ALLOW_VALUE_SIZE: usize = size_of::<gw_allow_value>();
pub(crate) const FAULT_SIZE: usize = size_of::<gw_fault_prob>();
pub(crate) const COUNTER_SIZE: usize = size_of::<gw_counter>();
