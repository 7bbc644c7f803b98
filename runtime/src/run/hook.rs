//! A role's view of the other ranks and of the parameter servers, for its executors:
//! the one [`CommHook`] of a worker and of a pipeline stage alike.
//!
//! The data axis's communicator runs on a communication thread of its own, in
//! program order, so that a bucket's all-reduce runs while the backward pass goes on;
//! the executor waits for it only where the result is read. The model axis's
//! collectives run on the role's own thread: on the forward path the next op reads
//! them at once, with nothing to overlap. Parameter-server ops go through the role's
//! [`PsClient`]. Every wait is timed into the step's communication wait, and, while
//! tracing, into spans.
//!
//! A hook is made with its communicators idle, so that a device backend can bootstrap
//! its own communicator over them first ([`HostHook::links`]); [`HostHook::start`]
//! then moves the data axis's onto its thread.

use crate::comm::collective::{collective, model_collective, op_label, Done};
use crate::comm::{ByteCount, Communicator, Links};
use crate::core::axis::Axis;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::{CommHook, Pending};
use crate::core::value::{Tensor, Value};
use crate::ps::PsClient;
use distc_ir::{NodeId, Op};
use ndarray::{ArrayD, IxDyn};
use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where a role blocked on which collective: `(node, step, start, end)`.
pub(crate) type WaitSpan = (NodeId, u64, Instant, Instant);

/// What the communication thread does for a request.
enum Job {
    /// An IR collective on the value (boxed: the other requests are small).
    Collective(Box<(Op, Value)>),
    /// A barrier of the axis; `step` names it.
    Barrier,
    /// A sum in f64 (a norm's parts), named by the label.
    SumF64(Vec<f64>, String),
}

struct Request {
    node: NodeId,
    job: Job,
    step: u64,
    reply: mpsc::Sender<Result<Value>>,
}

fn thread_stopped() -> RuntimeError {
    RuntimeError::internal(
        "the communication thread",
        "the communication thread stopped",
    )
}

struct Waiting(mpsc::Receiver<Result<Value>>);

impl Pending for Waiting {
    fn wait(self: Box<Self>) -> Result<Value> {
        self.0.recv().map_err(|_| thread_stopped())?
    }
}

/// A collective as the communication thread ran it.
pub(crate) struct CommSpan {
    pub(crate) node: NodeId,
    pub(crate) op: &'static str,
    pub(crate) step: u64,
    pub(crate) bytes: u64,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
}

/// A node the executor ran, as a trace records it.
pub(crate) struct NodeSpan {
    pub(crate) node: NodeId,
    pub(crate) op: &'static str,
    pub(crate) step: u64,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    /// Timed between two marks on the device (the kernels), not by the host.
    pub(crate) on_device: bool,
}

/// The communication thread: runs the requests in program order, timing each
/// collective.
fn comm_thread(
    mut comm: Box<dyn Communicator>,
    rx: mpsc::Receiver<Request>,
    spans: mpsc::Sender<CommSpan>,
    bytes: mpsc::Sender<ByteCount>,
) {
    for req in rx {
        let (op, value) = match req.job {
            Job::Collective(job) => *job,
            Job::Barrier => {
                comm.set_label(&format!("the barrier after step {}'s evaluation", req.step));
                let empty = Value::Tensor(Tensor::F32(ArrayD::zeros(IxDyn(&[0]))));
                let _ = req.reply.send(comm.barrier().map(|()| empty));
                continue;
            }
            Job::SumF64(mut xs, label) => {
                comm.set_label(&label);
                let r = comm
                    .all_reduce_f64(&mut xs, false)
                    .map(|()| Value::Tensor(Tensor::F64(ndarray::Array1::from_vec(xs).into_dyn())));
                // Its bytes before its answer: whoever waited for it reads them next.
                let _ = bytes.send(comm.bytes());
                let _ = req.reply.send(r);
                continue;
            }
        };
        comm.set_label(&op_label(&op, req.node, req.step));
        let before = comm.bytes();
        let start = Instant::now();
        let r = collective(comm.as_mut(), &op, value);
        let end = Instant::now();
        let after = comm.bytes();
        let _ = spans.send(CommSpan {
            node: req.node,
            op: op.mnemonic(),
            step: req.step,
            bytes: after.sent - before.sent,
            start,
            end,
        });
        let _ = bytes.send(after);
        let _ = req.reply.send(r);
    }
}

/// The data axis's communicator: idle until the role starts it, then on its thread.
enum Lane {
    None,
    Idle(Box<dyn Communicator>),
    Running {
        to_comm: mpsc::Sender<Request>,
        handle: JoinHandle<()>,
        spans: mpsc::Receiver<CommSpan>,
        bytes: mpsc::Receiver<ByteCount>,
        /// Its bytes at the last reading.
        latest: ByteCount,
    },
}

/// What a role's hook recorded while tracing, for its spans.
pub(crate) struct Traced {
    pub(crate) nodes: Vec<NodeSpan>,
    pub(crate) waits: Vec<WaitSpan>,
    pub(crate) comms: Vec<CommSpan>,
}

/// A role's view of the others and the servers, for the executor; see the module doc.
pub(crate) struct HostHook {
    data: Lane,
    model: Option<Box<dyn Communicator>>,
    /// The parameter servers, when the plan has any.
    pub(crate) ps: Option<PsClient>,
    trace: bool,
    /// The step running, for spans.
    pub(crate) step: u64,
    nodes: Vec<NodeSpan>,
    /// Time spent waiting for the model axis and servers in the current step.
    waited: Duration,
    /// While tracing: where the role blocked on which collective.
    waits: Arc<Mutex<Vec<WaitSpan>>>,
    /// Time spent waiting for the data axis's collectives in the current step.
    waited_shared: Arc<Mutex<Duration>>,
}

impl HostHook {
    /// A hook over the data axis's communicator and the model axis's (each where the
    /// role has one) and the servers, not started yet.
    pub(crate) fn new(
        data: Option<Box<dyn Communicator>>,
        model: Option<Box<dyn Communicator>>,
        ps: Option<PsClient>,
        trace: bool,
    ) -> HostHook {
        HostHook {
            data: data.map_or(Lane::None, Lane::Idle),
            model,
            ps,
            trace,
            step: 0,
            nodes: Vec::new(),
            waited: Duration::ZERO,
            waits: Arc::new(Mutex::new(Vec::new())),
            waited_shared: Arc::new(Mutex::new(Duration::ZERO)),
        }
    }

    /// Its communicators by axis, for a device communicator's bootstrap: before
    /// [`HostHook::start`] moves the data axis's onto its thread.
    pub(crate) fn links(&mut self) -> Links<'_> {
        let mut links = Links::none();
        if let Lane::Idle(c) = &mut self.data {
            links = links.with(Axis::Data, &mut **c);
        }
        if let Some(c) = self.model.as_mut() {
            links = links.with(Axis::Model, &mut **c);
        }
        links
    }

    /// Starts the data axis's communication thread, named for the role (`name`).
    pub(crate) fn start(&mut self, name: &str) -> Result<()> {
        let Lane::Idle(comm) = std::mem::replace(&mut self.data, Lane::None) else {
            return Ok(());
        };
        let latest = comm.bytes();
        let (to_comm, rx) = mpsc::channel::<Request>();
        let (span_tx, spans) = mpsc::channel();
        let (bytes_tx, bytes) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name(format!("{name}-comm"))
            .spawn(move || comm_thread(comm, rx, span_tx, bytes_tx))
            .map_err(|e| RuntimeError::no_thread(format!("{name}'s communication thread"), e))?;
        self.data = Lane::Running {
            to_comm,
            handle,
            spans,
            bytes,
            latest,
        };
        Ok(())
    }

    /// Hands `job` to the communication thread; what it answers comes through the
    /// receiver.
    fn send(&mut self, node: NodeId, job: Job, step: u64) -> Result<Waiting> {
        let Lane::Running { to_comm, .. } = &self.data else {
            return Err(RuntimeError::plan(format!(
                "{node} runs over the data axis, and this rank has no communicator among \
                 its replicas"
            )));
        };
        let (reply, rx) = mpsc::channel();
        to_comm
            .send(Request {
                node,
                job,
                step,
                reply,
            })
            .map_err(|_| thread_stopped())?;
        Ok(Waiting(rx))
    }

    /// The model axis's size: 1 without one.
    pub(crate) fn model_parts(&self) -> usize {
        self.model.as_ref().map_or(1, |c| c.size())
    }

    /// Whether the role has a model axis.
    pub(crate) fn has_model_axis(&self) -> bool {
        self.model.is_some()
    }

    /// Runs `op` over the model axis, named by `label`, on this thread.
    pub(crate) fn over_model(&mut self, op: &Op, v: Value, label: &str) -> Result<Value> {
        let Some(comm) = self.model.as_mut() else {
            return Err(RuntimeError::plan(format!(
                "{label} runs over the model axis, and this rank has no model-axis \
                 communicator"
            )));
        };
        let start = Instant::now();
        let v = model_collective(&mut **comm, op, v, label);
        self.waited += start.elapsed();
        v
    }

    /// The parts of `t` (split along `dim`) of every model rank, concatenated in rank
    /// order: a split variable (or its slot) whole. `what` names it.
    pub(crate) fn gather_model(&mut self, t: Tensor, dim: usize, what: &str) -> Result<Tensor> {
        let gather = Op::ModelGather {
            dim,
            parts: self.model_parts(),
        };
        let label = format!("the gathering of `{what}` from the model ranks");
        match self.over_model(&gather, Value::Tensor(t), &label)? {
            Value::Tensor(w) => Ok(w),
            v => Err(RuntimeError::plan(format!(
                "gathering `{what}` gave {}",
                v.value_type()
            ))),
        }
    }

    /// Every model rank's `mine`, in rank order (this role's alone without a model
    /// axis), named by `label`: what a stage's model ranks tell its model rank 0.
    pub(crate) fn gather_model_bytes(
        &mut self,
        mine: Vec<u8>,
        label: &str,
    ) -> Result<Vec<Vec<u8>>> {
        let Some(comm) = self.model.as_mut() else {
            return Ok(vec![mine]);
        };
        comm.set_label(label);
        let start = Instant::now();
        let all = comm.all_gather(mine);
        self.waited += start.elapsed();
        all
    }

    /// `xs` summed in f64 over `axis` (the data axis or the model axis), named by
    /// `label`; as they are where the role has no such axis. The data axis's sum goes
    /// through the communication thread, behind the collectives issued before it. A
    /// stage sums over its stages itself (the pipe axis is not the hook's).
    pub(crate) fn sum_f64(&mut self, axis: Axis, xs: Vec<f64>, label: String) -> Result<Vec<f64>> {
        let start = Instant::now();
        let summed = match axis {
            Axis::Model => match self.model.as_mut() {
                Some(comm) => {
                    let mut xs = xs;
                    comm.set_label(&label);
                    comm.all_reduce_f64(&mut xs, false)?;
                    xs
                }
                None => xs,
            },
            Axis::Data if matches!(self.data, Lane::None) => xs,
            Axis::Data => {
                let v = Box::new(self.send(NodeId(u32::MAX), Job::SumF64(xs, label), 0)?).wait()?;
                match v {
                    Value::Tensor(Tensor::F64(a)) => a.into_iter().collect(),
                    v => {
                        return Err(RuntimeError::internal(
                            "the communication thread",
                            format!("an f64 sum came back as {}", v.value_type()),
                        ))
                    }
                }
            }
            Axis::Pipe => {
                return Err(RuntimeError::internal(
                    "the communication hook",
                    format!("{label}: the hook has no pipe axis (a stage sums over its stages)"),
                ))
            }
        };
        self.waited += start.elapsed();
        Ok(summed)
    }

    /// Returns once every rank of the data axis has called it after step `step`
    /// (through the communication thread, behind the collectives issued before).
    pub(crate) fn barrier(&mut self, step: u64) -> Result<()> {
        if matches!(self.data, Lane::None) {
            return Ok(());
        }
        Box::new(self.send(NodeId(u32::MAX), Job::Barrier, step)?).wait()?;
        Ok(())
    }

    /// Returns once every rank of the mesh's data and model axes has called it: the
    /// data axis's barrier, then the model axis's (each model rank's replicas are all
    /// there before the model ranks meet).
    pub(crate) fn barrier_all(&mut self, step: u64) -> Result<()> {
        self.barrier(step)?;
        if let Some(comm) = self.model.as_mut() {
            comm.barrier()?;
        }
        Ok(())
    }

    /// The waits of the step so far, servers' and collectives' together.
    pub(crate) fn take_waited(&mut self) -> Duration {
        let collectives =
            std::mem::take(&mut *self.waited_shared.lock().unwrap_or_else(|p| p.into_inner()));
        std::mem::take(&mut self.waited) + collectives
    }

    /// Bytes its communicators have moved so far (the data axis's as of its last
    /// collective), the servers' traffic aside.
    pub(crate) fn bytes(&mut self) -> ByteCount {
        let data = match &mut self.data {
            Lane::None => ByteCount::default(),
            Lane::Idle(c) => c.bytes(),
            Lane::Running { bytes, latest, .. } => {
                while let Ok(b) = bytes.try_recv() {
                    *latest = b;
                }
                *latest
            }
        };
        data + self
            .model
            .as_ref()
            .map_or(ByteCount::default(), |c| c.bytes())
    }

    /// Gives step `step`'s spans of the ops in `timed` the times the device ran them
    /// at: each node's runs not yet timed, in the order they ran (a node runs once a
    /// micro-batch, and again in an evaluation).
    pub(crate) fn retime(&mut self, step: u64, timed: Vec<(NodeId, Instant, Instant)>) {
        let mut runs: HashMap<NodeId, VecDeque<(Instant, Instant)>> = HashMap::new();
        for (node, start, end) in timed {
            runs.entry(node).or_default().push_back((start, end));
        }
        let from = self
            .nodes
            .iter()
            .rposition(|s| s.step != step)
            .map_or(0, |i| i + 1);
        for s in self.nodes[from..].iter_mut().filter(|s| !s.on_device) {
            if let Some((start, end)) = runs.get_mut(&s.node).and_then(VecDeque::pop_front) {
                (s.start, s.end, s.on_device) = (start, end, true);
            }
        }
    }

    /// Ends the communication thread (once the collectives handed to it are done)
    /// and hands back what was traced.
    pub(crate) fn finish(mut self) -> Traced {
        let comms = match std::mem::replace(&mut self.data, Lane::None) {
            Lane::Running {
                to_comm,
                handle,
                spans,
                ..
            } => {
                drop(to_comm);
                let _ = handle.join();
                spans.try_iter().collect()
            }
            _ => Vec::new(),
        };
        let waits = std::mem::take(&mut *self.waits.lock().unwrap_or_else(|p| p.into_inner()));
        Traced {
            nodes: std::mem::take(&mut self.nodes),
            waits,
            comms,
        }
    }

    fn ps(&mut self) -> Result<&mut PsClient> {
        self.ps.as_mut().ok_or_else(|| {
            RuntimeError::plan("the plan pulls from parameter servers, but none were started")
        })
    }
}

impl Drop for HostHook {
    /// Ends the communication thread: a failing role's peers see its communicator
    /// close once the thread has let go of it.
    fn drop(&mut self) {
        if let Lane::Running {
            to_comm, handle, ..
        } = std::mem::replace(&mut self.data, Lane::None)
        {
            drop(to_comm);
            let _ = handle.join();
        }
    }
}

impl CommHook for HostHook {
    fn start_collective(
        &mut self,
        node: NodeId,
        op: &Op,
        v: Value,
        step: u64,
    ) -> Result<Box<dyn Pending>> {
        if op.is_model_collective() {
            let v = self.over_model(op, v, &op_label(op, node, step))?;
            return Ok(Box::new(Done(v)));
        }
        let inner = self.send(node, Job::Collective(Box::new((op.clone(), v))), step)?;
        Ok(Box::new(TimedWait {
            inner,
            node,
            step,
            trace: self.trace,
            spans: self.waits.clone(),
            waited: self.waited_shared.clone(),
        }))
    }

    fn pull(&mut self, var: &str, shards: &[(usize, usize, usize)], step: u64) -> Result<Tensor> {
        let start = Instant::now();
        let r = self.ps()?.pull(var, shards, step);
        self.waited += start.elapsed();
        r
    }

    fn sparse_pull(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        ids: &Tensor,
        step: u64,
    ) -> Result<Tensor> {
        let ids_dims = ids.shape().to_vec();
        let ids: Vec<i32> = ids
            .as_i32()
            .ok_or_else(|| RuntimeError::plan(format!("sparse_pull of `{var}`: ids are not i32")))?
            .iter()
            .copied()
            .collect();
        let start = Instant::now();
        let rows = self.ps()?.sparse_pull(var, shards, &ids, step);
        self.waited += start.elapsed();
        // The servers answer [ids, row...]; the program wants [ids dims..., row...].
        let rows = rows?;
        let mut dims = ids_dims;
        dims.extend_from_slice(&rows.shape()[1..]);
        rows.reshaped(&dims)
            .map_err(|e| RuntimeError::plan(format!("sparse_pull of `{var}`: {e}")))
    }

    fn push(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        grad: Value,
        step: u64,
    ) -> Result<()> {
        let start = Instant::now();
        let ps = self.ps()?;
        let r = match &grad {
            Value::Tensor(t) => ps.push(var, shards, t, step),
            Value::Slices(s) => ps.sparse_push(var, shards, s, step),
        };
        self.waited += start.elapsed();
        r
    }

    fn span(&mut self, node: NodeId, op: &'static str, start: Instant, end: Instant) {
        if self.trace {
            self.nodes.push(NodeSpan {
                node,
                op,
                step: self.step,
                start,
                end,
                on_device: false,
            });
        }
    }
}

/// Waits for a collective and adds the wait to the role's communication wait.
struct TimedWait {
    inner: Waiting,
    node: NodeId,
    step: u64,
    trace: bool,
    spans: Arc<Mutex<Vec<WaitSpan>>>,
    waited: Arc<Mutex<Duration>>,
}

impl Pending for TimedWait {
    fn wait(self: Box<Self>) -> Result<Value> {
        let start = Instant::now();
        let r = Box::new(self.inner).wait();
        let end = Instant::now();
        *self.waited.lock().unwrap_or_else(|p| p.into_inner()) += end - start;
        if self.trace {
            self.spans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((self.node, self.step, start, end));
        }
        r
    }
}
