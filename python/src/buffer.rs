//! The caller's array as the bytes an operation works on, in place (zero-copy).
//!
//! Accepted: a numpy.ndarray (or subclass) that is C-contiguous, of native byte order, aligned,
//! of dtype float32 or float16, and writeable when the operation writes into it; anything else
//! (a CPU torch tensor) goes through `gradwire._as_array`, which returns a numpy view of the same
//! memory and, for bfloat16, the dtype hint "bf16" with an int16 view.
//!
//! The memory is borrowed twice, both checked with the GIL held before the operation starts:
//! - through rust-numpy's borrow tracking (`try_readwrite`/`try_readonly`): the guard holds a
//!   reference to the array, so it stays alive, and marks it borrowed, which other rust-numpy
//!   extensions respect too. That tracking keys on the array's base object, and a torch
//!   tensor's numpy view (`t.detach().numpy()`) gets a new base each time, so it cannot see
//!   two operations on one tensor;
//! - in this module's own registry ([`BORROWED`]) of the byte ranges `[ptr, ptr + len)` that
//!   running operations use, whatever object they came from: a range written by one operation
//!   overlapping a range another one uses is refused (ConfigError); two operations that only
//!   read (two sends) may share memory.
//!
//! So a second gradwire operation on overlapping memory fails instead of aliasing it. What
//! neither can track is plain Python code: the caller must not write to the array, read it
//! during an in-place operation, or resize it (`ndarray.resize(refcheck=False)`) while the
//! operation runs with the GIL released.

use std::sync::{Mutex, PoisonError};

use gradwire_session::DType;
use numpy::{
    BorrowError, Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors;

/// The numpy element type behind a dtype.
#[derive(Debug, Clone, Copy)]
enum Elem {
    F32,
    F16,
    /// bfloat16 bits in an int16 view (torch's bfloat16 has no numpy dtype).
    I16,
    /// bfloat16 bits in a uint16 view.
    U16,
}

/// A writeable borrow of the array, held for the whole operation.
enum Writable<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    F16(PyReadwriteArrayDyn<'py, half::f16>),
    I16(PyReadwriteArrayDyn<'py, i16>),
    U16(PyReadwriteArrayDyn<'py, u16>),
}

/// A shared borrow of the array (operations that only read it: send).
enum Readable<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, half::f16>),
    I16(PyReadonlyArrayDyn<'py, i16>),
    U16(PyReadonlyArrayDyn<'py, u16>),
}

/// An array checked and borrowed for an operation that writes into it.
pub(crate) struct ArrayMut<'py> {
    borrow: Writable<'py>,
    _claim: Claim,
    pub(crate) dtype: DType,
}

/// An array checked and borrowed for an operation that only reads it.
pub(crate) struct ArrayRef<'py> {
    borrow: Readable<'py>,
    _claim: Claim,
    pub(crate) dtype: DType,
}

/// One running operation's memory: `[start, end)`, and whether it writes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    start: usize,
    end: usize,
    writes: bool,
    id: u64,
}

/// The memory of every running operation, with the id to give the next one. Checked and
/// changed with the GIL held, and never held while waiting for anything.
static BORROWED: Mutex<(Vec<Range>, u64)> = Mutex::new((Vec::new(), 0));

/// An operation's entry in [`BORROWED`], removed when dropped (after the operation).
#[derive(Debug)]
pub(crate) struct Claim(Option<u64>);

impl Claim {
    /// Registers `len` bytes at `start`, or ConfigError if a running operation uses
    /// overlapping memory and either of the two writes into it.
    fn new(py: Python<'_>, start: usize, len: usize, writes: bool, op: &str) -> PyResult<Claim> {
        if len == 0 {
            return Ok(Claim(None));
        }
        let end = start.saturating_add(len);
        let mut borrowed = BORROWED.lock().unwrap_or_else(PoisonError::into_inner);
        let (ranges, next) = &mut *borrowed;
        if ranges
            .iter()
            .any(|r| r.start < end && start < r.end && (r.writes || writes))
        {
            return Err(in_use(py, op, "overlapping memory"));
        }
        let id = *next;
        *next += 1;
        ranges.push(Range {
            start,
            end,
            writes,
            id,
        });
        Ok(Claim(Some(id)))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(id) = self.0 {
            let mut borrowed = BORROWED.lock().unwrap_or_else(PoisonError::into_inner);
            borrowed.0.retain(|r| r.id != id);
        }
    }
}

impl<'py> ArrayMut<'py> {
    /// Checks `obj` for operation `op` and borrows it writeable.
    pub(crate) fn new(py: Python<'py>, obj: &Bound<'py, PyAny>, op: &str) -> PyResult<Self> {
        let (array, elem, dtype) = checked(py, obj, op)?;
        let (borrow, (start, len)) = match elem {
            Elem::F32 => writeable(py, &array, op).map(|(b, m)| (Writable::F32(b), m))?,
            Elem::F16 => writeable(py, &array, op).map(|(b, m)| (Writable::F16(b), m))?,
            Elem::I16 => writeable(py, &array, op).map(|(b, m)| (Writable::I16(b), m))?,
            Elem::U16 => writeable(py, &array, op).map(|(b, m)| (Writable::U16(b), m))?,
        };
        let _claim = Claim::new(py, start, len, true, op)?;
        Ok(ArrayMut {
            borrow,
            _claim,
            dtype,
        })
    }

    /// The array's memory as bytes, for as long as the borrow lives.
    pub(crate) fn bytes(&mut self, py: Python<'_>) -> PyResult<&mut [u8]> {
        let bytes = match &mut self.borrow {
            Writable::F32(a) => a.as_slice_mut().map(bytemuck::cast_slice_mut),
            Writable::F16(a) => a.as_slice_mut().map(bytemuck::cast_slice_mut),
            Writable::I16(a) => a.as_slice_mut().map(bytemuck::cast_slice_mut),
            Writable::U16(a) => a.as_slice_mut().map(bytemuck::cast_slice_mut),
        };
        bytes.map_err(|_| not_contiguous(py))
    }
}

impl<'py> ArrayRef<'py> {
    /// Checks `obj` for operation `op` and borrows it read-only (read-only arrays are fine).
    pub(crate) fn new(py: Python<'py>, obj: &Bound<'py, PyAny>, op: &str) -> PyResult<Self> {
        let (array, elem, dtype) = checked(py, obj, op)?;
        let (borrow, (start, len)) = match elem {
            Elem::F32 => readonly(py, &array, op).map(|(b, m)| (Readable::F32(b), m))?,
            Elem::F16 => readonly(py, &array, op).map(|(b, m)| (Readable::F16(b), m))?,
            Elem::I16 => readonly(py, &array, op).map(|(b, m)| (Readable::I16(b), m))?,
            Elem::U16 => readonly(py, &array, op).map(|(b, m)| (Readable::U16(b), m))?,
        };
        let _claim = Claim::new(py, start, len, false, op)?;
        Ok(ArrayRef {
            borrow,
            _claim,
            dtype,
        })
    }

    /// The array's memory as bytes, for as long as the borrow lives.
    pub(crate) fn bytes(&self, py: Python<'_>) -> PyResult<&[u8]> {
        let bytes = match &self.borrow {
            Readable::F32(a) => a.as_slice().map(bytemuck::cast_slice),
            Readable::F16(a) => a.as_slice().map(bytemuck::cast_slice),
            Readable::I16(a) => a.as_slice().map(bytemuck::cast_slice),
            Readable::U16(a) => a.as_slice().map(bytemuck::cast_slice),
        };
        bytes.map_err(|_| not_contiguous(py))
    }
}

/// An array lent to an operation that outlives the call starting it (a started operation):
/// a strong reference keeps the memory alive, and the claim in [`BORROWED`] keeps other
/// gradwire operations off it, until this is dropped (after the operation ends). rust-numpy's
/// own borrow flags cannot be held that long; the registry covers gradwire's operations.
pub(crate) struct Lent {
    /// The address and length of the memory, in bytes.
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _claim: Claim,
    _array: Py<PyUntypedArray>,
}

impl Lent {
    /// `obj` checked for an operation that writes into it: a float array (or CPU torch
    /// tensor, as for the blocking calls), or with `raw` a C-contiguous uint8 ndarray (the
    /// bytes of any tensor, for operations that only move data).
    pub(crate) fn new(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        raw: bool,
        op: &str,
    ) -> PyResult<Lent> {
        let (array, (ptr, len), dtype) = if raw {
            let a = obj.cast::<numpy::PyArrayDyn<u8>>().map_err(|_| {
                errors::config(
                    py,
                    format!("{op}: expected the tensor's bytes as a numpy uint8 array"),
                )
            })?;
            if !a.is_c_contiguous() {
                return Err(not_contiguous(py));
            }
            (a.as_untyped().clone(), memory(a), DType::Raw)
        } else {
            let (array, elem, dtype) = checked(py, obj, op)?;
            let mem = match elem {
                Elem::F32 => memory(&typed::<f32>(py, &array)?),
                Elem::F16 => memory(&typed::<half::f16>(py, &array)?),
                Elem::I16 => memory(&typed::<i16>(py, &array)?),
                Elem::U16 => memory(&typed::<u16>(py, &array)?),
            };
            (array, mem, dtype)
        };
        if !array
            .getattr("flags")?
            .getattr("writeable")?
            .extract::<bool>()?
        {
            return Err(borrow_error(py, &BorrowError::NotWriteable, op));
        }
        let _claim = Claim::new(py, ptr, len, true, op)?;
        Ok(Lent {
            ptr,
            len,
            dtype,
            _claim,
            _array: array.unbind(),
        })
    }
}

/// A copy of `obj`'s bytes and their dtype, for a send: a float array or tensor (as `send`
/// takes), or with `raw` a C-contiguous numpy uint8 array.
pub(crate) fn copied(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    raw: bool,
    op: &str,
) -> PyResult<(Vec<u8>, DType)> {
    if raw {
        let a = obj
            .cast::<numpy::PyArrayDyn<u8>>()
            .map_err(|_| errors::config(py, format!("{op}: raw=True takes a numpy uint8 array")))?;
        let r = a.try_readonly().map_err(|e| borrow_error(py, &e, op))?;
        return Ok((
            r.as_slice().map_err(|_| not_contiguous(py))?.to_vec(),
            DType::Raw,
        ));
    }
    let a = ArrayRef::new(py, obj, op)?;
    Ok((a.bytes(py)?.to_vec(), a.dtype))
}

fn not_contiguous(py: Python<'_>) -> PyErr {
    errors::config(
        py,
        "the array is not C-contiguous: pass numpy.ascontiguousarray(a) (or t.contiguous()) \
         and use the result afterwards",
    )
}

/// `obj` as a C-contiguous, native-order, aligned ndarray with the element type and dtype the
/// operation sees.
fn checked<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    op: &str,
) -> PyResult<(Bound<'py, PyUntypedArray>, Elem, DType)> {
    let (array, hint) = match obj.cast::<PyUntypedArray>() {
        Ok(array) => (array.clone(), None),
        Err(_) => from_package(py, obj)?,
    };
    if !array.is_c_contiguous() {
        return Err(not_contiguous(py));
    }
    let descr = array.dtype();
    if descr.is_native_byteorder() == Some(false) {
        return Err(errors::config(
            py,
            format!(
                "{op}: the array's byte order is not the machine's (dtype {descr}): convert with \
                 a.astype(a.dtype.newbyteorder('='))"
            ),
        ));
    }
    let (kind, size) = (descr.kind(), descr.itemsize());
    let (elem, dtype) = match (hint.as_deref(), kind, size) {
        (None, b'f', 4) => (Elem::F32, DType::F32),
        (None, b'f', 2) => (Elem::F16, DType::F16),
        (Some("bf16"), b'i', 2) => (Elem::I16, DType::Bf16),
        (Some("bf16"), b'u', 2) => (Elem::U16, DType::Bf16),
        (Some(other), ..) if other != "bf16" => {
            return Err(errors::config(
                py,
                format!("{op}: gradwire._as_array returned the unknown dtype hint {other:?}"),
            ))
        }
        _ => {
            return Err(errors::config(
                py,
                format!(
                    "{op}: gradwire works on float32 and float16 arrays (and bfloat16 CPU torch \
                     tensors), not dtype {descr}: convert with a.astype(numpy.float32)"
                ),
            ))
        }
    };
    Ok((array, elem, dtype))
}

/// A non-ndarray through the package's `_as_array` (torch tensors; it raises ConfigError for
/// what it cannot take).
fn from_package<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyUntypedArray>, Option<String>)> {
    let converted = py.import("gradwire")?.getattr("_as_array")?.call1((obj,))?;
    let pair = converted.cast::<PyTuple>().map_err(|_| {
        errors::internal(
            py,
            "gradwire._as_array must return (numpy.ndarray, dtype hint)",
        )
    })?;
    let array = pair
        .get_item(0)?
        .cast_into::<PyUntypedArray>()
        .map_err(|_| errors::internal(py, "gradwire._as_array returned no numpy.ndarray"))?;
    let hint: Option<String> = pair.get_item(1)?.extract()?;
    Ok((array, hint))
}

/// The typed view of `array`, aligned for its element type.
fn typed<'py, T: Element>(
    py: Python<'py>,
    array: &Bound<'py, PyUntypedArray>,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let typed = array
        .as_any()
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| errors::internal(py, "array dtype changed while being checked"))?
        .clone();
    // numpy makes unaligned arrays only on request (frombuffer at an odd offset, packed
    // structs); a slice of them would be unsound, so they are refused.
    if typed.len() > 0 && (typed.data() as usize) % std::mem::align_of::<T>() != 0 {
        return Err(errors::config(
            py,
            "the array's memory is not aligned to its element size: pass a copy (a.copy())",
        ));
    }
    Ok(typed)
}

/// The memory of a typed array: its address and length in bytes.
fn memory<T: Element>(array: &Bound<'_, PyArrayDyn<T>>) -> (usize, usize) {
    (
        array.data() as usize,
        array.len().saturating_mul(std::mem::size_of::<T>()),
    )
}

/// A writeable borrow of `array` and its memory.
fn writeable<'py, T: Element>(
    py: Python<'py>,
    array: &Bound<'py, PyUntypedArray>,
    op: &str,
) -> PyResult<(PyReadwriteArrayDyn<'py, T>, (usize, usize))> {
    let typed = typed::<T>(py, array)?;
    let borrow = typed
        .try_readwrite()
        .map_err(|e| borrow_error(py, &e, op))?;
    Ok((borrow, memory(&typed)))
}

/// A shared borrow of `array` and its memory.
fn readonly<'py, T: Element>(
    py: Python<'py>,
    array: &Bound<'py, PyUntypedArray>,
    op: &str,
) -> PyResult<(PyReadonlyArrayDyn<'py, T>, (usize, usize))> {
    let typed = typed::<T>(py, array)?;
    let borrow = typed.try_readonly().map_err(|e| borrow_error(py, &e, op))?;
    Ok((borrow, memory(&typed)))
}

fn borrow_error(py: Python<'_>, err: &BorrowError, op: &str) -> PyErr {
    match err {
        BorrowError::NotWriteable => errors::config(
            py,
            format!(
                "{op} writes the result into the array, but it is read-only \
                 (flags.writeable is False): pass a writeable copy (a.copy())"
            ),
        ),
        _ => in_use(py, op, &err.to_string()),
    }
}

fn in_use(py: Python<'_>, op: &str, detail: &str) -> PyErr {
    errors::config(
        py,
        format!(
            "{op}: the array's memory is in use by another gradwire operation (another thread \
             or session, or the same array or tensor passed twice): wait for it or pass a \
             separate array ({detail})"
        ),
    )
}
