//! `Endpoint` and `Session`: the session API with the GIL released for every blocking call.
//!
//! A Session is one Rust `Session` behind a Mutex: one operation at a time. A second thread
//! calling into the same Session while an operation runs *waits* for it (the wait, like the
//! operation, releases the GIL, so the first operation's priority callable can still run).
//! `close()` waits the same way, then drops the session (its links close); any later call
//! raises UnusableError. The one call that would wait forever, a priority callable calling
//! back into the session whose `send` runs it, raises ConfigError instead.

use std::any::Any;
use std::net::{SocketAddr, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use gradwire_session::{
    self as gs, P2pOptions, PriorityFn, ReduceOp, ReduceOptions, SegmentInfo, SessionError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::buffer::Lent;
use crate::buffer::{ArrayMut, ArrayRef};
use crate::config::{self, Keywords};
use crate::errors;
use crate::priority::{self, Priority};
use crate::reports::{BroadcastReport, RecvReport, ReduceReport, SendReport};
use crate::work::{self, Work};

/// What a call run with the GIL released ended with.
enum Outcome<T> {
    Done(Result<T, SessionError>),
    /// The object was closed (or consumed) before the call.
    Closed,
    /// The Rust code panicked: a bug, reported as InternalError.
    Panicked(String),
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// `f` with panics caught: none may unwind into Python.
fn guarded<T>(f: impl FnOnce() -> Result<T, SessionError>) -> Outcome<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => Outcome::Done(result),
        Err(payload) => Outcome::Panicked(panic_message(payload.as_ref())),
    }
}

/// The Python value of an outcome.
fn finish<T>(py: Python<'_>, what: &str, outcome: Outcome<T>) -> PyResult<T> {
    match outcome {
        Outcome::Done(Ok(value)) => Ok(value),
        Outcome::Done(Err(err)) => Err(errors::session(py, &err)),
        Outcome::Closed => Err(errors::unusable(
            py,
            format!(
                "{what}: the session is closed: build a new one (Endpoint or Session.rendezvous)"
            ),
        )),
        Outcome::Panicked(message) => Err(errors::internal(
            py,
            format!("{what}: gradwire panicked (a bug; the session was dropped): {message}"),
        )),
    }
}

/// Phase 1 of setting up a session: this rank's sockets, bound, and the address every other
/// rank must receive (through the caller's own all-gather).
#[pyclass(module = "gradwire._native", frozen)]
pub(crate) struct Endpoint {
    /// Taken by `connect` (which consumes the Rust endpoint).
    inner: Mutex<Option<gs::Endpoint>>,
    address: Vec<u8>,
    rank: usize,
    world: usize,
}

#[pymethods]
impl Endpoint {
    #[new]
    #[pyo3(signature = (rank, world, ip, *, job = 1, loss_bound = 0.0, timeout = 30.0,
        secret = None, inject_loss = 0.0, seed = 0, point_to_point = true, rate_bps = None, mtu = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: i64,
        world: i64,
        ip: &str,
        job: i64,
        loss_bound: f64,
        timeout: f64,
        secret: Option<&Bound<'_, PyAny>>,
        inject_loss: f64,
        seed: i128,
        point_to_point: bool,
        rate_bps: Option<i64>,
        mtu: Option<i64>,
    ) -> PyResult<Self> {
        let secret = config::secret(py, secret)?;
        let kw = Keywords {
            job,
            loss_bound,
            timeout,
            secret,
            inject_loss,
            seed: config::seed(py, seed)?,
            point_to_point,
            rate_bps,
            mtu,
        };
        let cfg = config::session_config(py, rank, world, ip, kw)?;
        let (rank, world) = (cfg.rank, cfg.world);
        let endpoint = finish(
            py,
            "Endpoint",
            py.detach(|| guarded(|| gs::Endpoint::bind(cfg))),
        )?;
        Ok(Endpoint {
            address: endpoint.address().to_vec(),
            inner: Mutex::new(Some(endpoint)),
            rank,
            world,
        })
    }

    /// This rank's address: opaque bytes every rank must receive, in rank order, for `connect`.
    #[getter]
    fn address<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.address)
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world(&self) -> usize {
        self.world
    }

    /// Phase 2: `table[r]` is rank r's `address` (own included). Consumes the endpoint; the GIL
    /// is released while the links are set up.
    fn connect(&self, py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<Session> {
        let table = address_table(py, table)?;
        let outcome = py.detach(|| {
            let endpoint = self
                .inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match endpoint {
                None => Outcome::Closed,
                Some(endpoint) => guarded(|| endpoint.connect(&table)),
            }
        });
        let session = match outcome {
            Outcome::Closed => {
                return Err(errors::unusable(
                    py,
                    "Endpoint.connect: this endpoint was already connected (or its connect \
                     failed): bind a new Endpoint",
                ))
            }
            other => finish(py, "Endpoint.connect", other)?,
        };
        Ok(Session::wrap(session))
    }

    fn __repr__(&self) -> String {
        // try_lock: never wait for a lock while holding the GIL.
        let state = match self.inner.try_lock() {
            Ok(inner) if inner.is_none() => ", connected",
            _ => "",
        };
        format!("Endpoint(rank={}, world={}{state})", self.rank, self.world)
    }
}

/// The endpoint table: a sequence of bytes-like addresses.
fn address_table(py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for (r, item) in table.try_iter()?.enumerate() {
        let item = item?;
        if item.is_instance_of::<PyString>() {
            return Err(errors::config(
                py,
                format!("table[{r}] is a str: give rank {r}'s Endpoint.address bytes"),
            ));
        }
        out.push(item.extract::<Vec<u8>>().map_err(|_| {
            errors::config(
                py,
                format!("table[{r}] is not bytes: give rank {r}'s Endpoint.address"),
            )
        })?);
    }
    Ok(out)
}

/// A connected session: collectives and point-to-point transfers on numpy arrays and CPU
/// torch tensors, in place, with the GIL released.
#[pyclass(module = "gradwire._native", frozen)]
pub(crate) struct Session {
    inner: Mutex<Option<gs::Session>>,
    rank: usize,
    world: usize,
    /// Unique in this process: what a running priority callable is marked with.
    id: u64,
}

/// The id of the next Session.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Session {
    fn wrap(session: gs::Session) -> Session {
        Session {
            rank: session.rank(),
            world: session.world(),
            inner: Mutex::new(Some(session)),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// ConfigError if this thread runs this session's priority callable: the session is
    /// locked by the `send` calling it, so waiting for the lock would never end.
    fn not_from_own_priority(&self, py: Python<'_>, what: &str) -> PyResult<()> {
        if priority::inside_priority_of(self.id) {
            return Err(errors::config(
                py,
                format!(
                    "{what}: a priority function may not use its own session (it runs inside \
                     this session's send, which holds the session until it returns): tag the \
                     segment and return, and make the call after send"
                ),
            ));
        }
        Ok(())
    }

    /// Runs `f` on the session with the GIL released, one call at a time.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut gs::Session) -> Result<T, SessionError> + Send,
    ) -> PyResult<T> {
        self.not_from_own_priority(py, what)?;
        let outcome = py.detach(|| {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(session) = inner.as_mut() else {
                return Outcome::Closed;
            };
            let outcome = guarded(|| f(session));
            if matches!(outcome, Outcome::Panicked(_)) {
                // Its state is unknown after a panic; dropping it may panic again.
                let dropped = inner.take();
                let _ = catch_unwind(AssertUnwindSafe(move || drop(dropped)));
            }
            outcome
        });
        finish(py, what, outcome)
    }
}

impl Session {
    /// Starts an operation on `lent` memory (or none): the Work owns both.
    fn start(
        &self,
        py: Python<'_>,
        what: &'static str,
        lent: Option<Lent>,
        f: impl FnOnce(&gs::Session, Option<gs::Region>) -> Result<gs::Work, SessionError> + Send,
    ) -> PyResult<Work> {
        let region = lent.as_ref().map(work::region);
        let work = self.run(py, what, |s| f(s, region))?;
        Ok(Work::new(what, work, lent))
    }
}

/// The all-reduce options from the keywords.
#[allow(clippy::too_many_arguments)]
fn reduce_options(
    py: Python<'_>,
    op: &str,
    loss_bound: Option<f64>,
    layer: i64,
    num_layers: i64,
    dscp: Option<i64>,
    algorithm: &str,
    step_deadline: Option<&Bound<'_, PyAny>>,
) -> PyResult<ReduceOptions> {
    let step_deadline = self::step_deadline(py, step_deadline)?;
    let algorithm = gs::AllReduceAlgo::parse(algorithm).ok_or_else(|| {
        errors::config(
            py,
            format!("algorithm {algorithm:?} is not one of 'auto', 'ring', 'direct'"),
        )
    })?;
    Ok(ReduceOptions {
        op: reduce_op(py, op)?,
        loss_bound: self::loss_bound(py, loss_bound)?,
        layer: config::small(py, "layer", layer, u16::MAX.into())?,
        num_layers: config::small(py, "num_layers", num_layers, u16::MAX.into())?,
        dscp: dscp.map(|d| config::dscp(py, d)).transpose()?,
        algorithm,
        step_deadline,
        ..ReduceOptions::default()
    })
}

/// `tagging=`: how a bounded all-reduce tags its lossy segments.
fn tagging(py: Python<'_>, t: &str) -> PyResult<gs::Tagging> {
    match t {
        "magnitude" => Ok(gs::Tagging::Magnitude),
        "layer" => Ok(gs::Tagging::Layer),
        _ => Err(errors::config(
            py,
            format!(
                "tagging {t:?} is not 'magnitude' (DLCP: ECN-capable by gradient magnitude) \
                 or 'layer' (every segment ECN-capable)"
            ),
        )),
    }
}

/// `ranges=`: (start, end) element pairs, ascending, disjoint and non-empty, each held to
/// the loss bound on its own.
fn loss_ranges(
    py: Python<'_>,
    pairs: Vec<(usize, usize)>,
) -> PyResult<Vec<std::ops::Range<usize>>> {
    let mut end = 0;
    for &(a, b) in &pairs {
        if a < end || a >= b {
            return Err(errors::config(
                py,
                format!(
                    "ranges: ({a}, {b}) is not a non-empty (start, end) element range after the \
                     previous one (ending at {end}); give ascending, disjoint ranges"
                ),
            ));
        }
        end = b;
    }
    Ok(pairs.into_iter().map(|(a, b)| a..b).collect())
}

/// `step_deadline=`: None, a positive number of seconds, or "adaptive".
fn step_deadline(py: Python<'_>, d: Option<&Bound<'_, PyAny>>) -> PyResult<gs::StepDeadline> {
    let Some(d) = d.filter(|d| !d.is_none()) else {
        return Ok(gs::StepDeadline::None);
    };
    if d.is_instance_of::<PyString>() {
        return match d.extract::<String>()?.as_str() {
            "adaptive" => Ok(gs::StepDeadline::ADAPTIVE),
            other => Err(errors::config(
                py,
                format!("step_deadline {other:?} is not a number of seconds nor 'adaptive'"),
            )),
        };
    }
    match d.extract::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(gs::StepDeadline::Fixed(
            std::time::Duration::from_secs_f64(s),
        )),
        _ => Err(errors::config(
            py,
            format!("step_deadline {d} is not a positive number of seconds nor 'adaptive'"),
        )),
    }
}

fn reduce_op(py: Python<'_>, op: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(op).ok_or_else(|| {
        errors::config(
            py,
            format!("op {op:?} is not one of \"sum\", \"average\", \"min\", \"max\", \"product\""),
        )
    })
}

/// The options of a send or receive, checked.
fn p2p_options(
    py: Python<'_>,
    tensor: i64,
    layer: i64,
    num_layers: i64,
    loss_bound: Option<f64>,
) -> PyResult<P2pOptions> {
    Ok(P2pOptions {
        tensor: config::small(py, "tensor", tensor, u32::MAX.into())?,
        layer: config::small(py, "layer", layer, u16::MAX.into())?,
        num_layers: config::small(py, "num_layers", num_layers, u16::MAX.into())?,
        loss_bound: self::loss_bound(py, loss_bound)?,
    })
}

/// A loss bound in [0, 1), or None for the session's default.
fn loss_bound(py: Python<'_>, bound: Option<f64>) -> PyResult<Option<f64>> {
    match bound {
        Some(b) if !(0.0..1.0).contains(&b) => Err(errors::config(
            py,
            format!("loss_bound {b} is outside [0, 1): 0 is reliable, 0.1 tolerates 10% loss"),
        )),
        other => Ok(other),
    }
}

#[pymethods]
impl Session {
    /// Both set-up phases through gradwire's own rendezvous at `master` ("host:port"; rank 0
    /// serves it on that port).
    #[staticmethod]
    #[pyo3(signature = (master, rank, world, ip, *, job = 1, loss_bound = 0.0, timeout = 30.0,
        secret = None, inject_loss = 0.0, seed = 0, point_to_point = true, rate_bps = None, mtu = None))]
    #[allow(clippy::too_many_arguments)]
    fn rendezvous(
        py: Python<'_>,
        master: &str,
        rank: i64,
        world: i64,
        ip: &str,
        job: i64,
        loss_bound: f64,
        timeout: f64,
        secret: Option<&Bound<'_, PyAny>>,
        inject_loss: f64,
        seed: i128,
        point_to_point: bool,
        rate_bps: Option<i64>,
        mtu: Option<i64>,
    ) -> PyResult<Session> {
        let secret = config::secret(py, secret)?;
        let kw = Keywords {
            job,
            loss_bound,
            timeout,
            secret,
            inject_loss,
            seed: config::seed(py, seed)?,
            point_to_point,
            rate_bps,
            mtu,
        };
        let cfg = config::session_config(py, rank, world, ip, kw)?;
        let master_addr = master.to_owned();
        let resolved: Option<SocketAddr> = py.detach(|| {
            master_addr
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
        });
        let Some(master) = resolved else {
            return Err(errors::config(
                py,
                format!("master {master:?} is not a reachable host:port, e.g. \"10.0.0.1:29500\""),
            ));
        };
        let session = finish(
            py,
            "Session.rendezvous",
            py.detach(|| guarded(|| gs::Session::rendezvous(cfg, master))),
        )?;
        Ok(Session::wrap(session))
    }

    /// Both set-up phases with the caller's all-gather (like the C library's
    /// `gw_session_init`): `allgather(address)` gets this rank's address bytes and returns
    /// every rank's, in rank order (e.g. through torch.distributed's store or MPI).
    #[staticmethod]
    #[pyo3(signature = (allgather, rank, world, ip, *, job = 1, loss_bound = 0.0,
        timeout = 30.0, secret = None, inject_loss = 0.0, seed = 0, point_to_point = true,
        rate_bps = None, mtu = None))]
    #[allow(clippy::too_many_arguments)]
    fn init(
        py: Python<'_>,
        allgather: &Bound<'_, PyAny>,
        rank: i64,
        world: i64,
        ip: &str,
        job: i64,
        loss_bound: f64,
        timeout: f64,
        secret: Option<&Bound<'_, PyAny>>,
        inject_loss: f64,
        seed: i128,
        point_to_point: bool,
        rate_bps: Option<i64>,
        mtu: Option<i64>,
    ) -> PyResult<Session> {
        let endpoint = Endpoint::new(
            py,
            rank,
            world,
            ip,
            job,
            loss_bound,
            timeout,
            secret,
            inject_loss,
            seed,
            point_to_point,
            rate_bps,
            mtu,
        )?;
        let table = allgather.call1((endpoint.address(py),))?;
        endpoint.connect(py, &table)
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world(&self) -> usize {
        self.world
    }

    /// Reduces `array` over all ranks, in place.
    #[pyo3(signature = (array, *, op = "sum", loss_bound = None, layer = 0, num_layers = 0,
        dscp = None, algorithm = "auto", step_deadline = None, ranges = None,
        tagging = "magnitude", verify_results = false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        op: &str,
        loss_bound: Option<f64>,
        layer: i64,
        num_layers: i64,
        dscp: Option<i64>,
        algorithm: &str,
        step_deadline: Option<&Bound<'_, PyAny>>,
        ranges: Option<Vec<(usize, usize)>>,
        tagging: &str,
        verify_results: bool,
    ) -> PyResult<ReduceReport> {
        let mut opts = reduce_options(
            py,
            op,
            loss_bound,
            layer,
            num_layers,
            dscp,
            algorithm,
            step_deadline,
        )?;
        opts.ranges = loss_ranges(py, ranges.unwrap_or_default())?;
        opts.tagging = self::tagging(py, tagging)?;
        opts.verify_results = verify_results;
        let mut array = ArrayMut::new(py, array, "all_reduce")?;
        let dtype = array.dtype;
        let bytes = array.bytes(py)?;
        let report = self.run(py, "all_reduce", |s| s.all_reduce(dtype, bytes, &opts))?;
        Ok(report.into())
    }

    /// Copies root's `array` into every other rank's, in place.
    #[pyo3(signature = (array, root, *, loss_bound = None, layer = 0, num_layers = 0))]
    fn broadcast(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        root: i64,
        loss_bound: Option<f64>,
        layer: i64,
        num_layers: i64,
    ) -> PyResult<BroadcastReport> {
        let root = config::index(py, "root", root)?;
        let opts = ReduceOptions {
            loss_bound: self::loss_bound(py, loss_bound)?,
            layer: config::small(py, "layer", layer, u16::MAX.into())?,
            num_layers: config::small(py, "num_layers", num_layers, u16::MAX.into())?,
            ..ReduceOptions::default()
        };
        let mut array = ArrayMut::new(py, array, "broadcast")?;
        let dtype = array.dtype;
        let bytes = array.bytes(py)?;
        let report = self.run(py, "broadcast", |s| s.broadcast(root, dtype, bytes, &opts))?;
        Ok(report.into())
    }

    /// Returns once every rank has entered it.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, "barrier", gs::Session::barrier)
    }

    /// Sends `array` to `peer` (which calls `recv` with an array of the same size and dtype).
    #[pyo3(signature = (array, peer, *, tensor = 0, layer = 0, num_layers = 0, loss_bound = None,
        priority = None))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        peer: i64,
        tensor: i64,
        layer: i64,
        num_layers: i64,
        loss_bound: Option<f64>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SendReport> {
        let peer = config::index(py, "peer", peer)?;
        let opts = p2p_options(py, tensor, layer, num_layers, loss_bound)?;
        let priority = Priority::new(py, priority, self.id)?;
        let array = ArrayRef::new(py, array, "send")?;
        let dtype = array.dtype;
        let bytes = array.bytes(py)?;
        let report = self.run(py, "send", |s| match &priority {
            Priority::Default => s.send(peer, dtype, bytes, &opts, None),
            Priority::Fixed(tag) => {
                let tag = *tag;
                let fixed = move |_: &SegmentInfo<'_>| tag;
                s.send(peer, dtype, bytes, &opts, Some(&fixed as &PriorityFn<'_>))
            }
            Priority::Callable(cb) => {
                let call = |seg: &SegmentInfo<'_>| cb.tag(seg);
                s.send(peer, dtype, bytes, &opts, Some(&call as &PriorityFn<'_>))
            }
        })?;
        if let Priority::Callable(cb) = &priority {
            if let Some(err) = cb.failure(py) {
                return Err(err);
            }
        }
        Ok(report.into())
    }

    /// Receives `peer`'s `send` into `array`, in place.
    #[pyo3(signature = (array, peer, *, tensor = 0, layer = 0, num_layers = 0, loss_bound = None))]
    #[allow(clippy::too_many_arguments)]
    fn recv(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        peer: i64,
        tensor: i64,
        layer: i64,
        num_layers: i64,
        loss_bound: Option<f64>,
    ) -> PyResult<RecvReport> {
        let peer = config::index(py, "peer", peer)?;
        let opts = p2p_options(py, tensor, layer, num_layers, loss_bound)?;
        let mut array = ArrayMut::new(py, array, "recv")?;
        let dtype = array.dtype;
        let bytes = array.bytes(py)?;
        let report = self.run(py, "recv", |s| s.recv(peer, dtype, bytes, &opts))?;
        Ok(report.into())
    }

    /// Starts an all-reduce of `array` in place (the options of `all_reduce`); returns a Work.
    #[pyo3(signature = (array, *, op = "sum", loss_bound = None, layer = 0, num_layers = 0,
        dscp = None, algorithm = "auto", step_deadline = None, ranges = None,
        tagging = "magnitude", verify_results = false))]
    #[allow(clippy::too_many_arguments)]
    fn start_all_reduce(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        op: &str,
        loss_bound: Option<f64>,
        layer: i64,
        num_layers: i64,
        dscp: Option<i64>,
        algorithm: &str,
        step_deadline: Option<&Bound<'_, PyAny>>,
        ranges: Option<Vec<(usize, usize)>>,
        tagging: &str,
        verify_results: bool,
    ) -> PyResult<Work> {
        let mut opts = reduce_options(
            py,
            op,
            loss_bound,
            layer,
            num_layers,
            dscp,
            algorithm,
            step_deadline,
        )?;
        opts.ranges = loss_ranges(py, ranges.unwrap_or_default())?;
        opts.tagging = self::tagging(py, tagging)?;
        opts.verify_results = verify_results;
        let lent = Lent::new(py, array, false, "start_all_reduce")?;
        let dtype = lent.dtype;
        self.start(py, "all_reduce", Some(lent), move |s, r| {
            s.start_all_reduce(dtype, lent_region(r)?, &opts)
        })
    }

    /// Starts a reduce-scatter of `array` in place: this rank's chunk (`chunk`) ends with the
    /// reduction of every rank's chunk there.
    #[pyo3(signature = (array, *, op = "sum", loss_bound = None, layer = 0, num_layers = 0,
        dscp = None))]
    #[allow(clippy::too_many_arguments)]
    fn start_reduce_scatter(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        op: &str,
        loss_bound: Option<f64>,
        layer: i64,
        num_layers: i64,
        dscp: Option<i64>,
    ) -> PyResult<Work> {
        let opts = reduce_options(py, op, loss_bound, layer, num_layers, dscp, "ring", None)?;
        let lent = Lent::new(py, array, false, "start_reduce_scatter")?;
        let dtype = lent.dtype;
        self.start(py, "reduce_scatter", Some(lent), move |s, r| {
            s.start_reduce_scatter(dtype, lent_region(r)?, &opts)
        })
    }

    /// Starts an all-gather in place of `array`, a numpy uint8 array: rank r's chunk
    /// (`chunk`), filled by rank r, reaches every rank. Reliable.
    fn start_all_gather(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<Work> {
        let lent = Lent::new(py, array, true, "start_all_gather")?;
        self.start(py, "all_gather", Some(lent), |s, r| {
            s.start_all_gather(lent_region(r)?)
        })
    }

    /// Starts a broadcast of `array` (a numpy uint8 array: any tensor's bytes) from `root`.
    #[pyo3(signature = (array, root, *, loss_bound = None))]
    fn start_broadcast(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        root: i64,
        loss_bound: Option<f64>,
    ) -> PyResult<Work> {
        let root = config::index(py, "root", root)?;
        let opts = ReduceOptions {
            loss_bound: self::loss_bound(py, loss_bound)?,
            ..ReduceOptions::default()
        };
        let lent = Lent::new(py, array, true, "start_broadcast")?;
        self.start(py, "broadcast", Some(lent), move |s, r| {
            s.start_broadcast(root, gs::DType::Raw, lent_region(r)?, &opts)
        })
    }

    /// Starts a barrier.
    fn start_barrier(&self, py: Python<'_>) -> PyResult<Work> {
        self.start(py, "barrier", None, |s, _| s.start_barrier())
    }

    /// Starts a send of `array` to `peer` (copied first, so the array is free at once): a
    /// float array or tensor is tagged as `send` does; `raw=True` takes a numpy uint8 array
    /// (any tensor's bytes), sent with the layer's DSCP.
    #[pyo3(signature = (array, peer, *, tensor = 0, layer = 0, num_layers = 0, loss_bound = None,
        raw = false))]
    #[allow(clippy::too_many_arguments)]
    fn start_send(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        peer: i64,
        tensor: i64,
        layer: i64,
        num_layers: i64,
        loss_bound: Option<f64>,
        raw: bool,
    ) -> PyResult<Work> {
        let peer = config::index(py, "peer", peer)?;
        let opts = p2p_options(py, tensor, layer, num_layers, loss_bound)?;
        let (bytes, dtype) = crate::buffer::copied(py, array, raw, "start_send")?;
        self.start(py, "send", None, move |s, _| {
            s.start_send(peer, dtype, gs::Region::owned(bytes), &opts, None)
        })
    }

    /// Starts a receive of `peer`'s send into `array` (a numpy uint8 array of the sender's
    /// length in bytes), in place; segments that did not arrive are zero.
    #[pyo3(signature = (array, peer, *, tensor = 0, loss_bound = None))]
    fn start_recv(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        peer: i64,
        tensor: i64,
        loss_bound: Option<f64>,
    ) -> PyResult<Work> {
        let peer = config::index(py, "peer", peer)?;
        let opts = p2p_options(py, tensor, 0, 0, loss_bound)?;
        let lent = Lent::new(py, array, true, "start_recv")?;
        self.start(py, "recv", Some(lent), move |s, r| {
            s.start_recv(peer, lent_region(r)?, &opts)
        })
    }

    /// Bytes per block (one segment's payload) on the message layer: the unit of a
    /// reduction's telemetry and of the chunks of `start_reduce_scatter`/`start_all_gather`.
    #[getter]
    fn block_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, "block_bytes", |s| s.block_bytes())
    }

    /// `(start, end)` in bytes of rank `c`'s chunk of a `length`-byte array in
    /// `start_reduce_scatter` and `start_all_gather` (`world * k * block_bytes` bytes give
    /// every rank `k` whole blocks).
    fn chunk(&self, py: Python<'_>, length: usize, c: i64) -> PyResult<(usize, usize)> {
        let c = config::index(py, "c", c)?;
        if c >= self.world {
            return Err(errors::config(
                py,
                format!("rank {c} is not below world {}", self.world),
            ));
        }
        let r = self.run(py, "chunk", |s| s.chunk(length, c))?;
        Ok((r.start, r.end))
    }

    /// Whether the session runs on the message layer (started operations need it; a session
    /// with `message_layer` off runs on the flow transport).
    #[getter]
    fn message_layer(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, "message_layer", |s| Ok(s.message_layer()))
    }

    /// The message layer's counters as a dict of ints (frames, resends, refusals, system
    /// calls: what a benchmark compares; in an authenticated job also the datagrams that did
    /// not open, `unauthenticated`, and the replays, `replayed`), or None when the session
    /// does not run on the layer.
    fn message_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.run(py, "message_stats", |s| Ok(s.message_stats()))? else {
            return Ok(None);
        };
        let c = &s.core;
        let d = PyDict::new(py);
        for (k, v) in [
            ("data_sent", c.data_sent),
            ("data_resent", c.data_resent),
            ("payload_bytes_sent", c.payload_bytes_sent),
            ("ctrl_sent", c.ctrl_sent),
            ("data_placed", c.data_placed),
            ("data_duplicate", c.data_duplicate),
            ("ctrl_received", c.ctrl_received),
            ("refused", c.refused),
            ("unexpected_kept", c.unexpected_kept),
            ("unexpected_dropped", c.unexpected_dropped),
            ("polls", c.polls),
            ("nacks", c.nacks),
            ("gap_nacks", c.gap_nacks),
            ("gap_resent", c.gap_resent),
            ("grants", c.grants),
            ("tail_copies", c.tail_copies),
            ("unknown_source", s.unknown_source),
            ("unauthenticated", s.unauthenticated),
            ("replayed", s.replayed),
            ("injected_drops", s.injected_drops),
            ("unreachable_reports", s.unreachable_reports),
            ("datagrams_in", s.datagrams_in),
            ("datagrams_out", s.datagrams_out),
            ("send_calls", s.send_calls),
            ("recv_calls", s.recv_calls),
        ] {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// Drops the session (its links close). Waits for a running operation; idempotent. From
    /// this session's own priority callable: ConfigError (it would wait for itself).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.not_from_own_priority(py, "close")?;
        py.detach(|| {
            let session = self
                .inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            // A panic while closing sockets must not unwind into Python; nothing is left to do.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(session)));
        });
        Ok(())
    }

    /// Whether `close()` ran (or a panic dropped the session). Does not wait for a running
    /// operation (never waits for the lock while holding the GIL): a session in use is open.
    #[getter]
    fn closed(&self) -> bool {
        match self.inner.try_lock() {
            Ok(inner) => inner.is_none(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().is_none(),
            Err(std::sync::TryLockError::WouldBlock) => false,
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The stub's signature, names included (the stub check in test_native.py compares them).
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        exc: &Bound<'_, PyAny>,
        tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        // Closed whatever the exception: nothing of it is needed.
        let _ = (exc_type, exc, tb);
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let closed = if self.closed() { ", closed" } else { "" };
        format!("Session(rank={}, world={}{closed})", self.rank, self.world)
    }
}

/// The region a started operation on lent memory gets.
fn lent_region(r: Option<gs::Region>) -> Result<gs::Region, SessionError> {
    r.ok_or_else(|| SessionError::InvalidArgument("no memory was lent to the operation".into()))
}
