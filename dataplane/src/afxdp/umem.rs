//! The UMEM: one contiguous area of equal frames shared with the kernel, preferably on 2 MiB
//! huge pages (fewer TLB misses at line rate), falling back to normal pages once, with a
//! message, when none are available.
#![allow(unsafe_code)]

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::syscall::Mapping;

/// Size of a huge page the UMEM asks for.
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether the "no huge pages" notice was printed (once per process).
static FALLBACK_SAID: AtomicBool = AtomicBool::new(false);

/// A frame area registered with an AF_XDP socket.
#[derive(Debug)]
pub struct Umem {
    map: Arc<Mapping>,
    frame_size: u32,
    frames: u32,
    hugepages: bool,
}

impl Umem {
    /// `frames` frames of `frame_size` bytes (a power of two, 2048..=4096 for aligned mode).
    pub fn new(frames: u32, frame_size: u32, want_huge: bool) -> io::Result<Umem> {
        if !(2048..=4096).contains(&frame_size) || !frame_size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("UMEM frame size {frame_size} must be 2048 or 4096"),
            ));
        }
        if frames == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "UMEM needs at least one frame",
            ));
        }
        let len = frames as usize * frame_size as usize;
        if want_huge {
            let huge_len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
            match Mapping::anonymous(huge_len, true) {
                Ok(map) => {
                    return Ok(Umem {
                        map: Arc::new(map),
                        frame_size,
                        frames,
                        hugepages: true,
                    })
                }
                Err(e) => {
                    if !FALLBACK_SAID.swap(true, Ordering::Relaxed) {
                        eprintln!(
                            "gradwire: no 2 MiB huge pages for the UMEM ({e}); using normal pages \
                             (reserve some with `echo N > /proc/sys/vm/nr_hugepages`)"
                        );
                    }
                }
            }
        }
        Ok(Umem {
            map: Arc::new(Mapping::anonymous(len, false)?),
            frame_size,
            frames,
            hugepages: false,
        })
    }

    /// Base address and length, for `XDP_UMEM_REG`.
    pub(crate) fn area(&self) -> (std::ptr::NonNull<u8>, usize) {
        (
            self.map.ptr(),
            self.frames as usize * self.frame_size as usize,
        )
    }

    /// Frame size in bytes.
    pub fn frame_size(&self) -> u32 {
        self.frame_size
    }

    /// Number of frames.
    pub fn frames(&self) -> u32 {
        self.frames
    }

    /// Whether the area is on huge pages.
    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    /// Address of frame `i`.
    pub fn frame_addr(&self, i: u32) -> u64 {
        u64::from(i) * u64::from(self.frame_size)
    }

    /// Base address of the frame holding `addr` (copy-mode RX descriptors point past the
    /// frame's headroom).
    pub fn frame_base(&self, addr: u64) -> u64 {
        addr & !(u64::from(self.frame_size) - 1)
    }

    fn check(&self, addr: u64, len: usize) -> Option<usize> {
        let start = usize::try_from(addr).ok()?;
        let end = start.checked_add(len)?;
        // A descriptor must stay within one frame and within the area.
        let frame_end = (self.frame_base(addr) + u64::from(self.frame_size)) as usize;
        (end <= self.frames as usize * self.frame_size as usize && end <= frame_end)
            .then_some(start)
    }

    /// The bytes `[addr, addr+len)`, if they lie within one frame.
    pub(crate) fn get(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let start = self.check(addr, len)?;
        // SAFETY: `check` proved the range lies inside the mapping. The kernel writes a frame
        // only while it owns it (on the FILL ring until it appears on RX); the caller reads
        // frames it took from RX and has not yet returned, so no write races this read.
        Some(unsafe { std::slice::from_raw_parts(self.map.ptr().as_ptr().add(start), len) })
    }

    /// The bytes `[addr, addr+len)` mutably, if they lie within one frame.
    pub(crate) fn get_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let start = self.check(addr, len)?;
        // SAFETY: in range (see `check`); `&mut self` makes this the only view from userspace,
        // and the caller writes only frames it owns (not on FILL or TX).
        Some(unsafe { std::slice::from_raw_parts_mut(self.map.ptr().as_ptr().add(start), len) })
    }
}

/// A second handle on a UMEM's memory for another thread.
///
/// Frames move between threads by *ownership*: a frame address is held by exactly one party
/// at a time (the kernel while on FILL or TX, the worker while it processes it, the API thread
/// while it has been lent a received or free frame through a channel), and only that party
/// touches the frame's bytes. The accessors are `unsafe` because that discipline is the
/// caller's to keep; `engine` is the only user.
#[derive(Debug, Clone)]
pub struct SharedUmem {
    map: Arc<Mapping>,
    frame_size: u32,
    frames: u32,
}

impl Umem {
    /// A handle for another thread (see [`SharedUmem`]).
    pub fn share(&self) -> SharedUmem {
        SharedUmem {
            map: Arc::clone(&self.map),
            frame_size: self.frame_size,
            frames: self.frames,
        }
    }
}

impl SharedUmem {
    fn check(&self, addr: u64, len: usize) -> Option<usize> {
        let start = usize::try_from(addr).ok()?;
        let end = start.checked_add(len)?;
        let frame_end =
            (addr & !(u64::from(self.frame_size) - 1)) as usize + self.frame_size as usize;
        (end <= self.frames as usize * self.frame_size as usize && end <= frame_end)
            .then_some(start)
    }

    /// The bytes `[addr, addr+len)` within one frame.
    ///
    /// # Safety
    /// The caller must own the frame holding `addr` (nobody writes it for the lifetime of the
    /// returned slice).
    pub unsafe fn get(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let start = self.check(addr, len)?;
        // SAFETY: in range (checked); the caller guarantees no concurrent writer.
        Some(unsafe { std::slice::from_raw_parts(self.map.ptr().as_ptr().add(start), len) })
    }

    /// The bytes `[addr, addr+len)` within one frame, writable.
    ///
    /// # Safety
    /// The caller must own the frame holding `addr` exclusively (nobody else reads or writes
    /// it for the lifetime of the returned slice).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get_mut(&self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let start = self.check(addr, len)?;
        // SAFETY: in range (checked); the caller guarantees exclusive access to the frame.
        Some(unsafe { std::slice::from_raw_parts_mut(self.map.ptr().as_ptr().add(start), len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_bounded() {
        let mut u = Umem::new(4, 2048, false).unwrap();
        assert!(!u.hugepages());
        assert_eq!(u.frame_addr(3), 6144);
        assert_eq!(u.frame_base(6144 + 256), 6144);
        assert!(u.get(6144, 2048).is_some());
        assert!(u.get(6144, 2049).is_none(), "crosses the end");
        assert!(u.get(2000, 100).is_none(), "crosses a frame boundary");
        assert!(u.get(u64::MAX, 1).is_none());
        u.get_mut(2048, 4).unwrap().copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(u.get(2048, 4).unwrap(), &[1, 2, 3, 4]);
        assert!(Umem::new(4, 3000, false).is_err());
        assert!(Umem::new(0, 2048, false).is_err());
    }
}
