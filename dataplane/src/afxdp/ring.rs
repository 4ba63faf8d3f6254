//! The four single-producer/single-consumer rings an AF_XDP socket shares with the kernel.
//!
//! FILL and TX are produced by us and consumed by the kernel; RX and COMPLETION the reverse.
//! Indices are free-running `u32`s; the producer publishes with a release store after writing
//! entries, the consumer reads the producer index with an acquire load before reading them.
#![allow(unsafe_code)]

use std::io;
use std::marker::PhantomData;
use std::mem::size_of;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};

use super::syscall::Mapping;

/// One ring mapped from the socket.
#[derive(Debug)]
pub struct Ring<T: Copy> {
    map: Mapping,
    producer: usize,
    consumer: usize,
    flags: usize,
    desc: usize,
    mask: u32,
    size: u32,
    /// Cached copy of the other side's index, refreshed only when it looks exhausted.
    cached: u32,
    _t: PhantomData<T>,
}

impl<T: Copy> Ring<T> {
    /// Map the ring described by `off` (from `XDP_MMAP_OFFSETS`) at page offset `pgoff`.
    pub fn map(
        fd: &OwnedFd,
        off: &libc::xdp_ring_offset,
        size: u32,
        pgoff: i64,
    ) -> io::Result<Ring<T>> {
        if !size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ring size {size} is not a power of two"),
            ));
        }
        let len = off.desc as usize + size as usize * size_of::<T>();
        let map = Mapping::ring(fd, len, pgoff)?;
        let ring = Ring {
            map,
            producer: off.producer as usize,
            consumer: off.consumer as usize,
            flags: off.flags as usize,
            desc: off.desc as usize,
            mask: size - 1,
            size,
            cached: 0,
            _t: PhantomData,
        };
        // The index words and the descriptor array must lie inside the mapping, aligned.
        for (o, what) in [
            (ring.producer, "producer"),
            (ring.consumer, "consumer"),
            (ring.flags, "flags"),
        ] {
            if o + 4 > len || o % 4 != 0 {
                return Err(io::Error::other(format!(
                    "kernel ring {what} offset {o} outside the mapping"
                )));
            }
        }
        if ring.desc % std::mem::align_of::<T>() != 0 {
            return Err(io::Error::other("kernel ring descriptors misaligned"));
        }
        Ok(ring)
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `map` checked that `off..off+4` lies in the mapping and is 4-aligned; the
        // word is shared with the kernel, which is why it is only accessed atomically.
        unsafe { &*self.map.ptr().as_ptr().add(off).cast::<AtomicU32>() }
    }

    fn slot(&self, index: u32) -> *mut T {
        let i = (index & self.mask) as usize;
        // SAFETY: `i < size` and the mapping holds `size` descriptors from `desc` (checked in
        // `map`), so the pointer stays in bounds.
        unsafe { self.map.ptr().as_ptr().add(self.desc).cast::<T>().add(i) }
    }

    /// Ring size in entries.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The kernel asks to be woken (need_wakeup) before it looks at this ring again.
    pub fn needs_wakeup(&self) -> bool {
        self.word(self.flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    /// Producer side (FILL, TX): free entries.
    pub fn free(&mut self) -> u32 {
        let prod = self.word(self.producer).load(Ordering::Relaxed);
        if self.size - prod.wrapping_sub(self.cached) == 0 {
            self.cached = self.word(self.consumer).load(Ordering::Acquire);
        }
        self.size - prod.wrapping_sub(self.cached)
    }

    /// Producer side (TX): entries published and not yet consumed by the kernel.
    pub fn pending(&mut self) -> u32 {
        let prod = self.word(self.producer).load(Ordering::Relaxed);
        self.cached = self.word(self.consumer).load(Ordering::Acquire);
        prod.wrapping_sub(self.cached)
    }

    /// Producer side: write as many of `items` as fit and publish them; returns how many.
    pub fn produce(&mut self, items: &[T]) -> usize {
        let mut free = self.free() as usize;
        if free < items.len() {
            self.cached = self.word(self.consumer).load(Ordering::Acquire);
            let prod = self.word(self.producer).load(Ordering::Relaxed);
            free = (self.size - prod.wrapping_sub(self.cached)) as usize;
        }
        let n = items.len().min(free);
        let prod = self.word(self.producer).load(Ordering::Relaxed);
        for (k, item) in items[..n].iter().enumerate() {
            // SAFETY: the slot is within the ring (see `slot`) and free: the kernel consumed
            // it (consumer index passed it), so it reads it only after our release store.
            unsafe { self.slot(prod.wrapping_add(k as u32)).write_volatile(*item) };
        }
        self.word(self.producer)
            .store(prod.wrapping_add(n as u32), Ordering::Release);
        n
    }

    /// Consumer side (RX, COMPLETION): entries ready to read.
    pub fn available(&mut self) -> u32 {
        let cons = self.word(self.consumer).load(Ordering::Relaxed);
        if self.cached.wrapping_sub(cons) == 0 {
            self.cached = self.word(self.producer).load(Ordering::Acquire);
        }
        self.cached.wrapping_sub(cons)
    }

    /// Consumer side: append up to `max` entries to `out` and release them; returns how many.
    pub fn consume(&mut self, max: usize, out: &mut Vec<T>) -> usize {
        let cons = self.word(self.consumer).load(Ordering::Relaxed);
        self.cached = self.word(self.producer).load(Ordering::Acquire);
        let n = (self.cached.wrapping_sub(cons) as usize)
            .min(max)
            .min(self.size as usize);
        for k in 0..n {
            // SAFETY: the slot is within the ring and was published by the kernel's release
            // store of the producer index that our acquire load observed.
            out.push(unsafe { self.slot(cons.wrapping_add(k as u32)).read_volatile() });
        }
        self.word(self.consumer)
            .store(cons.wrapping_add(n as u32), Ordering::Release);
        n
    }
}
