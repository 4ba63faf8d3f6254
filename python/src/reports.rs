//! The transfer reports as Python objects: read-only attributes, `to_dict()` and `__repr__`.

use gradwire_session::Contributors;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Lists longer than this are summarised in `__repr__` (a report may have one entry per block).
const REPR_LIST_MAX: usize = 8;

fn list_repr(values: &[f64]) -> String {
    if values.len() <= REPR_LIST_MAX {
        format!("{values:?}")
    } else {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        format!("[{} values, min {min:?}]", values.len())
    }
}

/// The outcome of an all-reduce (`Session.all_reduce`).
#[pyclass(module = "gradwire._native", frozen)]
#[derive(Debug, Clone)]
pub(crate) struct ReduceReport {
    #[pyo3(get)]
    elems: usize,
    #[pyo3(get)]
    blocks: usize,
    #[pyo3(get)]
    block_elems: usize,
    #[pyo3(get)]
    complete_blocks: usize,
    #[pyo3(get)]
    delivered_fraction: f64,
    #[pyo3(get)]
    rank_delivered: Vec<f64>,
    #[pyo3(get)]
    block_delivered: Vec<f64>,
    #[pyo3(get)]
    elapsed_s: f64,
    #[pyo3(get)]
    bytes_sent: u64,
    /// Kept compact (a bit set per block); listed only when Python asks.
    contributors: Contributors,
}

impl From<gradwire_session::ReduceReport> for ReduceReport {
    fn from(r: gradwire_session::ReduceReport) -> Self {
        ReduceReport {
            elems: r.elems,
            blocks: r.blocks,
            block_elems: r.block_elems,
            complete_blocks: r.complete_blocks,
            delivered_fraction: r.delivered_fraction,
            rank_delivered: r.rank_delivered,
            block_delivered: r.block_delivered,
            elapsed_s: r.elapsed_s,
            bytes_sent: r.bytes_sent,
            contributors: r.contributors,
        }
    }
}

#[pymethods]
impl ReduceReport {
    /// For each block, the ranks summed in it, ascending (its `block_delivered` is their
    /// number over the world size). Not in `to_dict()`: one list per block.
    #[getter]
    fn block_contributors(&self) -> Vec<Vec<usize>> {
        (0..self.contributors.blocks())
            .map(|b| self.contributors.ranks(b))
            .collect()
    }

    /// The fields as a dict (JSON-ready).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("elems", self.elems)?;
        d.set_item("blocks", self.blocks)?;
        d.set_item("block_elems", self.block_elems)?;
        d.set_item("complete_blocks", self.complete_blocks)?;
        d.set_item("delivered_fraction", self.delivered_fraction)?;
        d.set_item("rank_delivered", self.rank_delivered.clone())?;
        d.set_item("block_delivered", self.block_delivered.clone())?;
        d.set_item("elapsed_s", self.elapsed_s)?;
        d.set_item("bytes_sent", self.bytes_sent)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "ReduceReport(elems={}, blocks={}, block_elems={}, complete_blocks={}, \
             delivered_fraction={:?}, rank_delivered={}, block_delivered={}, elapsed_s={:?}, \
             bytes_sent={})",
            self.elems,
            self.blocks,
            self.block_elems,
            self.complete_blocks,
            self.delivered_fraction,
            list_repr(&self.rank_delivered),
            list_repr(&self.block_delivered),
            self.elapsed_s,
            self.bytes_sent
        )
    }
}

/// The outcome of a broadcast (`Session.broadcast`).
#[pyclass(module = "gradwire._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub(crate) struct BroadcastReport {
    blocks: usize,
    block_elems: usize,
    received_blocks: usize,
    block_received: Vec<bool>,
    elapsed_s: f64,
}

impl From<gradwire_session::BroadcastReport> for BroadcastReport {
    fn from(r: gradwire_session::BroadcastReport) -> Self {
        BroadcastReport {
            blocks: r.blocks,
            block_elems: r.block_elems,
            received_blocks: r.received_blocks,
            block_received: r.block_received,
            elapsed_s: r.elapsed_s,
        }
    }
}

#[pymethods]
impl BroadcastReport {
    /// The fields as a dict (JSON-ready).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("blocks", self.blocks)?;
        d.set_item("block_elems", self.block_elems)?;
        d.set_item("received_blocks", self.received_blocks)?;
        d.set_item("block_received", self.block_received.clone())?;
        d.set_item("elapsed_s", self.elapsed_s)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let flags = if self.block_received.len() <= REPR_LIST_MAX {
            format!("{:?}", self.block_received)
        } else {
            format!("[{} flags]", self.block_received.len())
        };
        format!(
            "BroadcastReport(blocks={}, block_elems={}, received_blocks={}, block_received={}, \
             elapsed_s={:?})",
            self.blocks, self.block_elems, self.received_blocks, flags, self.elapsed_s
        )
    }
}

/// The sender's side of a point-to-point transfer (`Session.send`).
#[pyclass(module = "gradwire._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub(crate) struct SendReport {
    segments: u32,
    bytes: u64,
    retransmitted_segments: u64,
    elapsed_s: f64,
    final_rate_bps: u64,
}

impl From<gradwire_session::SendSummary> for SendReport {
    fn from(r: gradwire_session::SendSummary) -> Self {
        SendReport {
            segments: r.segments,
            bytes: r.bytes,
            retransmitted_segments: r.retransmitted_segments,
            elapsed_s: r.elapsed_s,
            final_rate_bps: r.final_rate_bps,
        }
    }
}

#[pymethods]
impl SendReport {
    /// The fields as a dict (JSON-ready).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("segments", self.segments)?;
        d.set_item("bytes", self.bytes)?;
        d.set_item("retransmitted_segments", self.retransmitted_segments)?;
        d.set_item("elapsed_s", self.elapsed_s)?;
        d.set_item("final_rate_bps", self.final_rate_bps)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "SendReport(segments={}, bytes={}, retransmitted_segments={}, elapsed_s={:?}, \
             final_rate_bps={})",
            self.segments,
            self.bytes,
            self.retransmitted_segments,
            self.elapsed_s,
            self.final_rate_bps
        )
    }
}

/// The receiver's side of a point-to-point transfer (`Session.recv`).
#[pyclass(module = "gradwire._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub(crate) struct RecvReport {
    segments: u32,
    received_segments: u32,
    delivered_fraction: f64,
    missing: Vec<(u64, usize)>,
    loss_bound: f64,
    rounds: u32,
    elapsed_s: f64,
}

impl From<gradwire_session::RecvSummary> for RecvReport {
    fn from(r: gradwire_session::RecvSummary) -> Self {
        RecvReport {
            segments: r.segments,
            received_segments: r.received_segments,
            delivered_fraction: r.delivered_fraction,
            missing: r.missing,
            loss_bound: r.loss_bound,
            rounds: r.rounds,
            elapsed_s: r.elapsed_s,
        }
    }
}

#[pymethods]
impl RecvReport {
    /// The fields as a dict (JSON-ready).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("segments", self.segments)?;
        d.set_item("received_segments", self.received_segments)?;
        d.set_item("delivered_fraction", self.delivered_fraction)?;
        d.set_item("missing", self.missing.clone())?;
        d.set_item("loss_bound", self.loss_bound)?;
        d.set_item("rounds", self.rounds)?;
        d.set_item("elapsed_s", self.elapsed_s)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let missing = if self.missing.len() <= REPR_LIST_MAX {
            format!("{:?}", self.missing)
        } else {
            let bytes: usize = self.missing.iter().map(|&(_, n)| n).sum();
            format!("[{} ranges, {bytes} bytes]", self.missing.len())
        };
        format!(
            "RecvReport(segments={}, received_segments={}, delivered_fraction={:?}, \
             missing={missing}, loss_bound={:?}, rounds={}, elapsed_s={:?})",
            self.segments,
            self.received_segments,
            self.delivered_fraction,
            self.loss_bound,
            self.rounds,
            self.elapsed_s
        )
    }
}
