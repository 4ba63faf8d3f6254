//! Registered memory: the buffers messages are sent from and received into (Gloo's model:
//! a buffer is registered once, a message names a range of it).
//!
//! A [`Region`] either owns its bytes or borrows a caller's memory for the duration of a
//! blocking call ([`Region::borrowed`], `unsafe`: the caller promises the memory outlives the
//! registration). [`Buffers`] is the table a core resolves [`BufId`]s in; removing a buffer
//! hands its region back, and the core cancels every message on it first, so nothing touches
//! memory after it was returned.
#![allow(unsafe_code)]

use std::ops::Range;

/// A registered buffer's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub(crate) u32);

/// Memory a message may use.
#[derive(Debug)]
pub struct Region(Inner);

#[derive(Debug)]
enum Inner {
    Owned(Vec<u8>),
    Borrowed { ptr: *mut u8, len: usize },
}

// SAFETY: an owned region is a Vec; a borrowed one is memory whose owner promised in
// `Region::borrowed` that nobody else touches it while it is registered, so moving the
// pointer to the progress thread is sound.
unsafe impl Send for Region {}

impl Region {
    /// A region that owns `bytes`.
    pub fn owned(bytes: Vec<u8>) -> Region {
        Region(Inner::Owned(bytes))
    }

    /// A region over the caller's `bytes` without copying them.
    ///
    /// # Safety
    /// Until the region is dropped or returned by [`Buffers::remove`] (and the endpoint's
    /// call that registered it has returned), the memory must stay valid and nobody else may
    /// read or write it.
    pub unsafe fn borrowed(bytes: &mut [u8]) -> Region {
        Region(Inner::Borrowed {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Inner::Owned(v) => v.len(),
            Inner::Borrowed { len, .. } => *len,
        }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            Inner::Owned(v) => v,
            // SAFETY: `borrowed`'s contract: the memory is valid for `len` bytes and only this
            // region accesses it; the returned borrow is tied to `&self`.
            Inner::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Inner::Owned(v) => v,
            // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow.
            Inner::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }

    /// The owned bytes (`None` for a borrowed region).
    pub fn into_vec(self) -> Option<Vec<u8>> {
        match self.0 {
            Inner::Owned(v) => Some(v),
            Inner::Borrowed { .. } => None,
        }
    }
}

/// The table of registered buffers.
#[derive(Debug, Default)]
pub struct Buffers {
    slots: Vec<Option<Region>>,
    free: Vec<u32>,
}

impl Buffers {
    /// Registers `region`.
    pub fn insert(&mut self, region: Region) -> BufId {
        if let Some(i) = self.free.pop() {
            self.slots[i as usize] = Some(region);
            BufId(i)
        } else {
            self.slots.push(Some(region));
            BufId(self.slots.len() as u32 - 1)
        }
    }

    /// Unregisters a buffer and returns its region.
    pub fn remove(&mut self, id: BufId) -> Option<Region> {
        let r = self.slots.get_mut(id.0 as usize)?.take()?;
        self.free.push(id.0);
        Some(r)
    }

    /// Length of a buffer.
    pub fn len_of(&self, id: BufId) -> Option<usize> {
        Some(self.slots.get(id.0 as usize)?.as_ref()?.len())
    }

    /// `range` of a buffer (`None`: no such buffer or range).
    pub fn get(&self, id: BufId, range: Range<usize>) -> Option<&[u8]> {
        self.slots
            .get(id.0 as usize)?
            .as_ref()?
            .as_slice()
            .get(range)
    }

    /// `range` of a buffer, mutably.
    pub fn get_mut(&mut self, id: BufId, range: Range<usize>) -> Option<&mut [u8]> {
        self.slots
            .get_mut(id.0 as usize)?
            .as_mut()?
            .as_mut_slice()
            .get_mut(range)
    }

    /// A whole buffer.
    pub fn whole(&self, id: BufId) -> Option<&[u8]> {
        Some(self.slots.get(id.0 as usize)?.as_ref()?.as_slice())
    }

    /// A whole buffer, mutably.
    pub fn whole_mut(&mut self, id: BufId) -> Option<&mut [u8]> {
        Some(self.slots.get_mut(id.0 as usize)?.as_mut()?.as_mut_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_reused_and_ranges_checked() {
        let mut b = Buffers::default();
        let a = b.insert(Region::owned(vec![1, 2, 3]));
        let c = b.insert(Region::owned(vec![4; 8]));
        assert_eq!(b.get(a, 1..3), Some(&[2u8, 3][..]));
        assert_eq!(b.get(a, 2..4), None);
        assert_eq!(b.remove(a).and_then(Region::into_vec), Some(vec![1, 2, 3]));
        assert_eq!(b.get(a, 0..1), None);
        let d = b.insert(Region::owned(vec![9]));
        assert_eq!(d, a);
        assert_eq!(b.len_of(c), Some(8));
    }

    #[test]
    fn a_borrowed_region_writes_through() {
        let mut mem = vec![0u8; 4];
        {
            // SAFETY: `mem` outlives the region, which is dropped at the end of this block,
            // and is not touched meanwhile.
            let mut r = unsafe { Region::borrowed(&mut mem) };
            r.as_mut_slice()[2] = 7;
            assert!(r.into_vec().is_none());
        }
        assert_eq!(mem, [0, 0, 7, 0]);
    }
}
