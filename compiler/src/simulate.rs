//! `distc simulate` and `distc calibrate`: what a plan would do on more workers than
//! this machine has. One worker's step is replayed from the plan's own schedule, the
//! program order the executor follows: compute ops one after another on the worker's
//! thread, each taking the time a profile measured for an op of its kind and types;
//! collectives in the order they are started on the worker's one communication
//! thread, each taking the time the alpha-beta model gives it for the target's workers
//! and links; an op that reads a collective's result waits for it, as the executor's
//! `wait` does. The step's end, less what the worker computed, is the communication
//! the backward pass did not hide.
//!
//! The alpha-beta parameters come from `--link` or from `distc calibrate`, which times
//! all-reduces of growing buffers on the real transport (threads, or MPI ranks over
//! whatever network `mpirun` uses) and fits `2 (N-1) (alpha + bytes / (N bandwidth))`
//! to them by least squares.

use crate::limits::{MAX_TIMEOUT_SECS, MIN_BANDWIDTH, SAMPLE_BYTES};
use crate::plan::Plan;
use distc_ir::{Graph, NodeId, Op, ValueType};
use distc_passes::cost::INDEX_BYTES;
use distc_passes::placement::{all_reduce_seconds_by, Link, StrategyConfig, MAX_RANKS};
use distc_runtime::comm::calibrate::Sample;
use distc_runtime::run::launch::{launch, DeviceChoice, Launch, TransportChoice};
use distc_runtime::run::trace::Span;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What `distc calibrate` measured, and the link it fitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// `inprocess` or `mpi`.
    pub transport: String,
    /// Ranks in the ring.
    pub ranks: usize,
    /// Distinct hosts among them (1: the ring never left the machine).
    pub hosts: usize,
    /// Median seconds per all-reduce by buffer size.
    pub samples: Vec<Sample>,
    /// The fitted link.
    pub link: Link,
    /// Each sample's time as the fitted link predicts it, in the order of `samples`.
    pub predicted: Vec<f64>,
    /// Bytes per second of a memory copy on this machine (packing and unpacking).
    pub copy_bandwidth: f64,
    /// Median seconds of one message from rank 0 to rank 1 by size, sent alone (half a
    /// round trip): what a pipeline's messages between stages take. Empty in a
    /// calibration written before `calibrate` timed them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<Sample>,
}

/// The most seconds a calibration sample or a fitted latency may hold: the longest
/// `--timeout`, past which `calibrate` stops a collective. A larger time in a file was
/// not measured, and sums of such times overflow (a step of `inf` ms).
pub const MAX_SAMPLE_SECONDS: f64 = MAX_TIMEOUT_SECS;

/// Refuses buffer sizes that cannot be fitted (`what` names them for the message: a
/// flag or a field): a size given twice (two times for one size make the interpolation
/// between them divide by 0) or fewer than 2 sizes (any line goes through one point).
pub fn check_sizes(what: &str, sizes: &[usize]) -> Result<(), String> {
    let mut sorted = sizes.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!(
            "{what}: {} bytes is given more than once: give each buffer size once",
            w[0]
        ));
    }
    if sorted.len() < 2 {
        return Err(format!(
            "{what}: {} buffer size{}; a fit needs 2 or more",
            sorted.len(),
            if sorted.len() == 1 { "" } else { "s" }
        ));
    }
    Ok(())
}

impl Calibration {
    /// A calibration file's text, parsed and [checked](Calibration::check).
    pub fn from_json(text: &str) -> Result<Calibration, String> {
        let c: Calibration = serde_json::from_str(text)
            .map_err(|e| format!("not a calibration from `distc calibrate`: {e}"))?;
        c.check()?;
        Ok(c)
    }

    /// Every field in the range `calibrate` writes, else the first that is not, named
    /// as in the file with its value: ranks 2 to [`MAX_RANKS`], hosts 1 to the ranks,
    /// 2 or more buffer sizes (each once, in [`SAMPLE_BYTES`]), times finite, above 0
    /// and at most [`MAX_SAMPLE_SECONDS`], bandwidths finite and at least
    /// [`MIN_BANDWIDTH`]. The simulation
    /// sums and divides by these numbers: one out of range gives a negative, infinite
    /// or NaN prediction instead of an error.
    pub fn check(&self) -> Result<(), String> {
        // Numbers as `{:?}` writes them: 1e308, not 309 digits.
        let out = |field: &str, x: &dyn std::fmt::Debug, rule: &str| {
            Err(format!("`{field}` {x:?} is out of range: {rule}"))
        };
        if !matches!(self.transport.as_str(), "inprocess" | "mpi") {
            return out("transport", &self.transport, "give inprocess or mpi");
        }
        if !(2..=MAX_RANKS).contains(&self.ranks) {
            return out("ranks", &self.ranks, &format!("give 2 to {MAX_RANKS}"));
        }
        if !(1..=self.ranks).contains(&self.hosts) {
            return out(
                "hosts",
                &self.hosts,
                &format!("give 1 to the ranks ({})", self.ranks),
            );
        }
        let seconds = format!("give a time above 0 and at most {MAX_SAMPLE_SECONDS:e} s");
        for (field, samples) in [("samples", &self.samples), ("messages", &self.messages)] {
            if field == "messages" && samples.is_empty() {
                continue;
            }
            let sizes: Vec<usize> = samples.iter().map(|s| s.bytes).collect();
            check_sizes(&format!("`{field}`"), &sizes)?;
            for (i, s) in samples.iter().enumerate() {
                if !SAMPLE_BYTES.contains(&s.bytes) {
                    return out(
                        &format!("{field}[{i}].bytes"),
                        &s.bytes,
                        &format!("give {} to {}", SAMPLE_BYTES.start(), SAMPLE_BYTES.end()),
                    );
                }
                if !(s.seconds > 0.0 && s.seconds <= MAX_SAMPLE_SECONDS) {
                    return out(&format!("{field}[{i}].seconds"), &s.seconds, &seconds);
                }
            }
        }
        if self.predicted.len() != self.samples.len() {
            return Err(format!(
                "`predicted` holds {} times for {} samples: one each",
                self.predicted.len(),
                self.samples.len()
            ));
        }
        for (i, p) in self.predicted.iter().enumerate() {
            if !(p.is_finite() && *p >= 0.0) {
                return out(
                    &format!("predicted[{i}]"),
                    p,
                    "give a finite time of 0 or more",
                );
            }
        }
        let bandwidth = format!("give a finite number of bytes/s, at least {MIN_BANDWIDTH:?}");
        for (field, x) in [
            ("link.bandwidth", self.link.bandwidth),
            ("copy_bandwidth", self.copy_bandwidth),
        ] {
            if !(x.is_finite() && x >= MIN_BANDWIDTH) {
                return out(field, &x, &bandwidth);
            }
        }
        if !(0.0..=MAX_SAMPLE_SECONDS).contains(&self.link.latency) {
            return out(
                "link.latency",
                &self.link.latency,
                &format!("give 0 to {MAX_SAMPLE_SECONDS:e} s"),
            );
        }
        Ok(())
    }

    /// Fits `t = 2 (N-1) alpha + 2 (N-1)/N bytes / bandwidth` to `samples` by least
    /// squares, each sample weighted by 1/t so small and large buffers count alike
    /// (relative error); a negative fitted latency or inverse bandwidth is refitted as 0.
    pub fn fit(
        transport: &str,
        ranks: usize,
        hosts: usize,
        samples: Vec<Sample>,
        copy_bandwidth: f64,
    ) -> Result<Calibration, String> {
        if ranks < 2 {
            return Err(format!("a fit needs 2 or more ranks ({ranks} ranks)"));
        }
        let sizes: Vec<usize> = samples.iter().map(|s| s.bytes).collect();
        check_sizes("the buffer sizes", &sizes)?;
        let n = ranks as f64;
        // t = a x + b y, with x = 2 (N-1), y = 2 (N-1)/N bytes; a = alpha, b = 1/bw.
        let rows: Vec<(f64, f64, f64)> = samples
            .iter()
            .map(|s| {
                let w = 1.0 / s.seconds.max(1e-12);
                (
                    w * 2.0 * (n - 1.0),
                    w * 2.0 * (n - 1.0) / n * s.bytes as f64,
                    w * s.seconds,
                )
            })
            .collect();
        let dot = |f: &dyn Fn(&(f64, f64, f64)) -> f64| rows.iter().map(f).sum::<f64>();
        let (xx, xy, yy) = (
            dot(&|r| r.0 * r.0),
            dot(&|r| r.0 * r.1),
            dot(&|r| r.1 * r.1),
        );
        let (xt, yt) = (dot(&|r| r.0 * r.2), dot(&|r| r.1 * r.2));
        let det = xx * yy - xy * xy;
        let (mut a, mut b) = if det.abs() > 1e-300 {
            ((xt * yy - yt * xy) / det, (yt * xx - xt * xy) / det)
        } else {
            (0.0, yt / yy.max(1e-300))
        };
        if a < 0.0 {
            a = 0.0;
            b = yt / yy.max(1e-300);
        }
        if b <= 0.0 {
            // Time does not grow with size here: the largest buffer's rate bounds it.
            let last = samples.last().expect("two samples");
            b = last.seconds / (2.0 * (n - 1.0) / n * last.bytes as f64).max(1.0);
            a = (xt / xx.max(1e-300)).max(0.0);
        }
        let link = Link {
            bandwidth: 1.0 / b,
            latency: a,
        };
        let predicted = samples
            .iter()
            .map(|s| ring_all_reduce(s.bytes as f64, ranks, link))
            .collect();
        let c = Calibration {
            transport: transport.into(),
            ranks,
            hosts,
            samples,
            link,
            predicted,
            copy_bandwidth,
            messages: Vec::new(),
        };
        // What `calibrate` writes, `simulate` reads: the same checks.
        c.check()?;
        Ok(c)
    }

    /// A table of the samples against the fit, and the fitted link.
    pub fn render(&self) -> String {
        let mut out = format!(
            "{} ranks over {} ({} host{}); all-reduce, median of the repetitions\n{:>12} {:>12} {:>12} {:>8}\n",
            self.ranks,
            self.transport,
            self.hosts,
            if self.hosts == 1 { "" } else { "s" },
            "bytes",
            "measured us",
            "fitted us",
            "error"
        );
        for (s, p) in self.samples.iter().zip(&self.predicted) {
            out += &format!(
                "{:>12} {:>12.1} {:>12.1} {:>7.1}%\n",
                s.bytes,
                s.seconds * 1e6,
                p * 1e6,
                100.0 * (p - s.seconds) / s.seconds
            );
        }
        if !self.messages.is_empty() {
            out += &format!(
                "one message from rank 0 to rank 1, half the round trip\n{:>12} {:>12}\n",
                "bytes", "measured us"
            );
            for s in &self.messages {
                out += &format!("{:>12} {:>12.1}\n", s.bytes, s.seconds * 1e6);
            }
        }
        out += &format!(
            "link: bandwidth {:.4e} B/s, latency {:.3e} s (--link KIND={:.4e},{:.3e}); copies \
             {:.3e} B/s\n",
            self.link.bandwidth,
            self.link.latency,
            self.link.bandwidth,
            self.link.latency,
            self.copy_bandwidth
        );
        out
    }
}

impl Calibration {
    /// One ring step's seconds by message size as measured, smallest first (as
    /// [`Links::message`] interpolates them; `--sizes` may give them in any order):
    /// each sample's buffer over the ranks, and its time over the ring's `2 (N-1)` steps.
    pub fn ring_steps(&self) -> Vec<(f64, f64)> {
        let n = self.ranks.max(2) as f64;
        let mut steps: Vec<(f64, f64)> = self
            .samples
            .iter()
            .map(|s| (s.bytes as f64 / n, s.seconds / (2.0 * (n - 1.0))))
            .collect();
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        steps
    }

    /// One message's seconds by size as measured, smallest first (as
    /// [`Links::point_to_point`] interpolates them).
    pub fn message_times(&self) -> Vec<(f64, f64)> {
        let mut m: Vec<(f64, f64)> = self
            .messages
            .iter()
            .map(|s| (s.bytes as f64, s.seconds))
            .collect();
        m.sort_by(|a, b| a.0.total_cmp(&b.0));
        m
    }
}

/// A flat ring all-reduce of `bytes` over `n` ranks on `link`.
pub fn ring_all_reduce(bytes: f64, n: usize, link: Link) -> f64 {
    all_reduce_seconds_by(bytes, n, 1, |_, chunk| {
        link.latency + chunk / link.bandwidth
    })
    .0
}

/// What an op costs to compute, from a profile of one worker on this machine.
#[derive(Clone, Debug, Default)]
pub struct ComputeProfile {
    /// Where the times come from, for people.
    pub source: String,
    /// Median seconds by [`signature`] (op with attributes, input and output types).
    pub by_signature: HashMap<String, f64>,
    /// By mnemonic: (seconds, work: FLOPs of a product, else elements read and written)
    /// for an op of a kind measured at other sizes.
    pub by_mnemonic: HashMap<&'static str, (f64, f64)>,
    /// Seconds of the optimizer per byte of gradient it applies.
    pub optimizer_per_byte: f64,
    /// Median measured step of the profiled run.
    pub measured_step: f64,
    /// Bytes per second of a copy: the cost of an op of a kind never measured.
    pub copy_bandwidth: f64,
    /// The cores the profiled worker had, where the priced workers share a node of
    /// this machine's kind (a CPU profile made here); `None` prices each worker on a
    /// device of its own (a GPU's trace).
    pub cores: Option<Cores>,
}

/// A CPU node's cores, and the threads a profiled worker's matrix products ran on:
/// what prices several workers sharing one node. A profile times one worker alone;
/// `k` workers computing at once on `C` cores give an op of `r` threads
/// `C / (k r)` of its cores when they are oversubscribed, so it takes
/// `max(1, k r / C)` times as long (a linear speedup in threads assumed).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cores {
    /// The node's cores.
    pub cores: usize,
    /// Threads a matrix product runs on (`MATMUL_NUM_THREADS`, else every core; one
    /// value a process, read where the workers run as where they were profiled).
    pub product_threads: usize,
}

impl Cores {
    /// This machine's, as this process's products have them.
    pub fn here() -> Cores {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let product_threads = std::env::var("MATMUL_NUM_THREADS")
            .ok()
            .and_then(|t| t.trim().parse::<usize>().ok())
            .filter(|&t| t > 0)
            .map_or(cores, |t| t.min(cores));
        Cores {
            cores,
            product_threads,
        }
    }

    /// How many times longer an op of `threads` threads in the profile, `run_threads`
    /// in the run, takes with `busy` workers of the node computing at once.
    fn slowdown(&self, threads: usize, run_threads: usize, busy: f64) -> f64 {
        let (c, r) = (self.cores.max(1) as f64, run_threads.max(1) as f64);
        threads.max(1) as f64 / r * (busy * r / c).max(1.0)
    }

    /// The rayon threads of a large dense update among `workers` in all: every core
    /// where there are more cores than workers, else the worker's own thread
    /// (`Optimizer::set_parallel`, as the step loop sets it).
    fn update_threads(&self, workers: usize) -> usize {
        if self.cores > workers {
            self.cores
        } else {
            1
        }
    }
}

/// How the workers of a priced run share their node's cores: those computing at once
/// beside an op of one of them (itself included), and the workers of the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sharing {
    pub busy: f64,
    pub workers: usize,
}

impl Sharing {
    /// No sharing: every worker alone on its node.
    pub const ALONE: Sharing = Sharing {
        busy: 1.0,
        workers: 1,
    };

    /// `cfg`'s workers all computing at once: a node holds `--ranks-per-node` of them,
    /// or all of them when the plan has no nodes (threads or ranks of one machine).
    pub fn all_busy(cfg: &StrategyConfig) -> Sharing {
        let workers = workers_of(cfg);
        Sharing {
            busy: workers_per_node(cfg) as f64,
            workers,
        }
    }
}

/// Every worker of `cfg`'s layout: D x T x P.
fn workers_of(cfg: &StrategyConfig) -> usize {
    cfg.data_workers() * cfg.model.max(1) * cfg.pipeline.max(1)
}

/// The workers of `cfg` on one node: its `--ranks-per-node`, else all of them.
fn workers_per_node(cfg: &StrategyConfig) -> usize {
    let all = workers_of(cfg);
    match cfg.ranks_per_node {
        0 => all,
        l => l.min(all),
    }
}

/// An op's identity for its cost: the op with its attributes, its input types and its
/// result types (a `matmul` of other shapes, or a `conv2d` of another stride, is
/// another op).
pub fn signature(g: &Graph, id: NodeId) -> String {
    let n = g.node(id);
    let ins: Vec<String> = n
        .inputs
        .iter()
        .map(|v| format!("{:?}", g.value_type(*v)))
        .collect();
    format!("{:?} ({}) -> {:?}", n.op, ins.join(", "), n.outputs)
}

/// What an op's time scales with from one size to another: the products' FLOPs for
/// the product kinds (a matmul split over a model axis reads fewer elements for the
/// same FLOPs), the elements read and written for the rest.
fn work(g: &Graph, id: NodeId) -> f64 {
    if is_product(g.op(id)) {
        distc_passes::cost::node_flops(g, id)
    } else {
        elements(g, id)
    }
}

/// The matrix products: the ops whose time goes with FLOPs, and which run on the
/// product's threads.
fn is_product(op: &Op) -> bool {
    matches!(
        op,
        Op::MatMul { .. }
            | Op::Conv2d { .. }
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradFilter { .. }
    )
}

/// Elements an op reads and writes.
fn elements(g: &Graph, id: NodeId) -> f64 {
    let n = g.node(id);
    let count = |t: &ValueType| t.bytes() as f64 / 4.0;
    n.inputs
        .iter()
        .map(|v| count(g.value_type(*v)))
        .sum::<f64>()
        + n.outputs.iter().map(count).sum::<f64>()
}

/// Bytes of the gradients a worker's optimizer applies in a step (slices: their rows).
fn applied_bytes(g: &Graph) -> f64 {
    g.param_grads()
        .iter()
        .map(|(_, v)| g.value_type(*v).bytes() as f64)
        .sum()
}

fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

impl ComputeProfile {
    /// From the spans of worker 0 of a run of `g` (one span per node run, and an
    /// `update` and a `step N` span per step), leaving out steps before `from_step`.
    pub fn from_spans(
        g: &Graph,
        spans: &[Span],
        from_step: u64,
        copy_bandwidth: f64,
        source: String,
    ) -> Result<ComputeProfile, String> {
        let ids: HashMap<String, NodeId> = g
            .node_ids()
            .into_iter()
            .map(|id| (id.to_string(), id))
            .collect();
        let mut per_node: HashMap<NodeId, Vec<f64>> = HashMap::new();
        let (mut updates, mut steps) = (Vec::new(), Vec::new());
        for s in spans
            .iter()
            .filter(|s| s.track == "worker 0" && s.step >= from_step)
        {
            match &s.node {
                Some(node) if is_op_span(s) => {
                    if let Some(id) = ids.get(node) {
                        per_node.entry(*id).or_default().push(s.dur_us * 1e-6);
                    }
                }
                Some(_) => {}
                None if s.name == "update" => updates.push(s.dur_us * 1e-6),
                None if s.name.starts_with("step ") => steps.push(s.dur_us * 1e-6),
                None => {}
            }
        }
        if per_node.is_empty() {
            return Err("the profile holds no op of the program's worker 0".into());
        }
        let mut by_sig: HashMap<String, Vec<f64>> = HashMap::new();
        let mut by_mnemonic: HashMap<&'static str, (f64, f64)> = HashMap::new();
        for (id, mut times) in per_node {
            let t = median(&mut times);
            by_sig.entry(signature(g, id)).or_default().push(t);
            let e = by_mnemonic.entry(g.op(id).mnemonic()).or_default();
            e.0 += t;
            e.1 += work(g, id);
        }
        let by_signature = by_sig
            .into_iter()
            .map(|(k, v)| (k, v.iter().sum::<f64>() / v.len() as f64))
            .collect();
        let applied = applied_bytes(g);
        Ok(ComputeProfile {
            source,
            by_signature,
            by_mnemonic,
            optimizer_per_byte: if applied > 0.0 {
                median(&mut updates) / applied
            } else {
                0.0
            },
            measured_step: median(&mut steps),
            copy_bandwidth,
            cores: None,
        })
    }

    /// From the spans of a trace file of a run of `g` ([`check_spans_of`]): the first
    /// 2 steps left out (allocation, first touches) when it holds 4 or more.
    pub fn from_trace(
        g: &Graph,
        spans: &[Span],
        copy_bandwidth: f64,
        source: String,
    ) -> Result<ComputeProfile, String> {
        let first = spans.iter().map(|s| s.step).min().unwrap_or(0);
        let last = spans.iter().map(|s| s.step).max().unwrap_or(0);
        let skip = if last - first >= 3 { 2 } else { 0 };
        ComputeProfile::from_spans(g, spans, first + skip, copy_bandwidth, source)
    }

    /// Seconds of op `id` of `g`, and how it was found: no kernel (a source or a sink),
    /// the same op measured, the same kind at another size (scaled by elements), or a
    /// copy of its bytes.
    pub fn op_seconds(&self, g: &Graph, id: NodeId) -> (f64, &'static str) {
        // Sources are borrowed and sinks hand their value over: no kernel runs.
        if matches!(
            g.op(id),
            Op::Input { .. }
                | Op::Param { .. }
                | Op::Constant { .. }
                | Op::Loss
                | Op::ParamGrad { .. }
                | Op::Output { .. }
        ) {
            return (0.0, "free");
        }
        if let Some(t) = self.by_signature.get(&signature(g, id)) {
            return (*t, "measured");
        }
        if let Some((t, e)) = self.by_mnemonic.get(g.op(id).mnemonic()) {
            if *e > 0.0 {
                return (t * work(g, id) / e, "scaled");
            }
        }
        (elements(g, id) * 4.0 / self.copy_bandwidth.max(1.0), "copy")
    }

    /// This profile for workers sharing nodes of `cores`, as its source then says.
    pub fn on_shared_cores(mut self, cores: Cores) -> ComputeProfile {
        self.source += &format!(
            "; a node's workers share its {} cores, products on {} thread(s) each",
            cores.cores, cores.product_threads
        );
        self.cores = Some(cores);
        self
    }

    /// [`Self::op_seconds`] with the node's cores shared as `sharing` says: a product
    /// on its threads, any other op on one.
    pub fn shared_op_seconds(
        &self,
        g: &Graph,
        id: NodeId,
        sharing: Sharing,
    ) -> (f64, &'static str) {
        let (t, how) = self.op_seconds(g, id);
        let Some(cores) = self.cores else {
            return (t, how);
        };
        let threads = if is_product(g.op(id)) {
            cores.product_threads
        } else {
            1
        };
        (t * cores.slowdown(threads, threads, sharing.busy), how)
    }

    /// Seconds of the optimizer applying `g`'s gradients, the cores shared as
    /// `sharing` says: profiled alone, a large update ran on every core.
    pub fn update_seconds(&self, g: &Graph, sharing: Sharing) -> f64 {
        let t = self.optimizer_per_byte * applied_bytes(g);
        match self.cores {
            Some(cores) => {
                let (profiled, run) = (
                    cores.update_threads(1),
                    cores.update_threads(sharing.workers),
                );
                t * cores.slowdown(profiled, run, sharing.busy)
            }
            None => t,
        }
    }
}

impl ComputeProfile {
    /// One device's step of `single` (its ops, then the optimizer), from this profile.
    fn one_device_step(&self, single: &Graph) -> f64 {
        single
            .topo_order()
            .into_iter()
            .map(|id| self.op_seconds(single, id).0)
            .sum::<f64>()
            + self.optimizer_per_byte * applied_bytes(single)
    }
}

/// The links a simulation uses: within a node, and between nodes (or between any two
/// workers when the plan has no nodes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// Between workers of one node.
    pub intra: Link,
    /// Between nodes.
    pub inter: Link,
    /// Measured ring steps `(message bytes, seconds)` of the link within a node, by
    /// size (from a calibration; empty: the alpha-beta line alone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub intra_measured: Vec<(f64, f64)>,
    /// ... and of the link between nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inter_measured: Vec<(f64, f64)>,
    /// Measured point-to-point messages `(bytes, seconds)` within a node and between
    /// nodes (empty: priced as a ring step of their bytes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub intra_messages: Vec<(f64, f64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inter_messages: Vec<(f64, f64)>,
}

/// Ring steps `(message bytes, seconds)` that `distc calibrate` measured, by link:
/// what a calibrated link adds to its alpha-beta line (empty: the line alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasuredSteps {
    pub intra: Vec<(f64, f64)>,
    pub inter: Vec<(f64, f64)>,
    /// Point-to-point messages `(bytes, seconds)`, by link.
    pub intra_messages: Vec<(f64, f64)>,
    pub inter_messages: Vec<(f64, f64)>,
}

impl Links {
    /// These links with the measured ring steps and messages of the calibrated ones.
    pub fn with_measured(mut self, m: &MeasuredSteps) -> Links {
        self.intra_measured = m.intra.clone();
        self.inter_measured = m.inter.clone();
        self.intra_messages = m.intra_messages.clone();
        self.inter_messages = m.inter_messages.clone();
        self
    }

    /// The two links, as lines.
    pub fn new(intra: Link, inter: Link) -> Links {
        Links {
            intra,
            inter,
            intra_measured: Vec::new(),
            inter_measured: Vec::new(),
            intra_messages: Vec::new(),
            inter_messages: Vec::new(),
        }
    }

    /// Seconds of one point-to-point message of `bytes` (a pipeline stage's to its
    /// neighbour) between nodes (`inter`) or within one: interpolated between the
    /// message sizes a calibration measured, as [`Links::message`] does ring steps;
    /// without them, priced as a ring step.
    pub fn point_to_point(&self, inter: bool, bytes: f64) -> f64 {
        let (link, measured) = if inter {
            (self.inter, &self.inter_messages)
        } else {
            (self.intra, &self.intra_messages)
        };
        if measured.is_empty() {
            return self.message(inter, bytes);
        }
        along(link, measured, bytes)
    }

    /// Seconds of one message of `bytes` on the link between nodes (`inter`) or within
    /// one. Where a calibration measured the link, between two measured sizes the time
    /// is interpolated between them, and beyond them it goes on from the nearest at the
    /// fitted bandwidth: a transport's protocol changes with the size (eager, then
    /// rendezvous; a queue that starts to drop) bend the line that one alpha and beta
    /// draw, and the buckets' own sizes are the ones that matter.
    pub fn message(&self, inter: bool, bytes: f64) -> f64 {
        let (link, measured) = if inter {
            (self.inter, &self.inter_measured)
        } else {
            (self.intra, &self.intra_measured)
        };
        along(link, measured, bytes)
    }
}

/// Seconds of `bytes` on `link` through the sizes measured on it, `(bytes, seconds)`
/// smallest first: interpolated between two of them, and on from the nearest at the
/// link's bandwidth beyond them; the line alone without any.
fn along(link: Link, measured: &[(f64, f64)], bytes: f64) -> f64 {
    let line = |from: (f64, f64)| from.1 + (bytes - from.0) / link.bandwidth;
    match measured {
        [] => link.latency + bytes / link.bandwidth,
        [only] => line(*only).max(0.0),
        points => {
            if bytes <= points[0].0 {
                return line(points[0]).max(link.latency.min(points[0].1));
            }
            for w in points.windows(2) {
                let ((m0, t0), (m1, t1)) = (w[0], w[1]);
                if bytes <= m1 {
                    return t0 + (t1 - t0) * (bytes - m0) / (m1 - m0).max(1e-300);
                }
            }
            line(*points.last().expect("two points"))
        }
    }
}

/// One communication op of the simulated step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommOp {
    /// The IR node.
    pub node: String,
    /// Its op.
    pub op: String,
    /// Bytes of the buffer (one worker's).
    pub bytes: f64,
    /// Seconds as the plan runs it.
    pub seconds: f64,
    /// An all-reduce's seconds as one ring and as a hierarchy (when the plan has nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flat_seconds: Option<f64>,
    /// ... and hierarchically.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hierarchical_seconds: Option<f64>,
    /// `flat`, `hierarchical`, `ring`, `model ring` or `servers`.
    pub how: String,
    /// When it starts and ends, seconds from the step's start.
    pub start: f64,
    /// End.
    pub end: f64,
}

/// A simulated step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// Workers.
    pub workers: usize,
    /// Parameter servers (0: none).
    #[serde(default)]
    pub servers: usize,
    /// Seconds of the step's ops on the servers' links (pulls and pushes).
    #[serde(default)]
    pub server_comm: f64,
    /// Workers per node (0: no nodes).
    pub ranks_per_node: usize,
    /// The links.
    pub links: Links,
    /// Seconds of one worker's step.
    pub step: f64,
    /// Seconds the worker computed (ops and optimizer).
    pub compute: f64,
    /// Seconds of communication in all (the communication thread's busy time).
    pub comm: f64,
    /// Seconds the worker waited on communication (the part not hidden).
    pub exposed_comm: f64,
    /// `1 - exposed / comm`: the share of communication the compute hid.
    pub overlap: f64,
    /// One device's step (same per-worker batch, no communication), simulated from the
    /// same profile.
    pub single_step: f64,
    /// `single_step / step`: samples per second per worker against one device's.
    pub scaling_efficiency: f64,
    /// Bytes one worker holds (variables, gradients, optimizer state, peak activations,
    /// buckets, its batch).
    pub memory_per_worker: u128,
    /// How many ops' times were measured, scaled from another size, or priced as copies
    /// (sources and sinks, which run no kernel, are none of them).
    pub op_times: (usize, usize, usize),
    /// Each communication op, in the order started.
    pub comms: Vec<CommOp>,
    /// A pipelined plan's stages and schedule, as simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineSimulation>,
}

/// A pipelined step: the stages' programs run in their schedule, messages between
/// stages on the links, then each stage's all-reduces among its replicas and its update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineSimulation {
    /// Stages P.
    pub stages: usize,
    /// Micro-batches per step M.
    pub micro_batches: usize,
    /// `gpipe` or `1f1b`.
    pub schedule: String,
    /// Per stage: seconds of one micro-batch's forward and backward (its model-axis
    /// collectives included).
    pub forward: Vec<f64>,
    pub backward: Vec<f64>,
    /// Per boundary (stage s to s + 1): seconds of one micro-batch's activations
    /// forward, and of its gradients back.
    pub activation_message: Vec<f64>,
    pub gradient_message: Vec<f64>,
    /// Per stage: when its last backward ends, then its all-reduces among replicas and
    /// its update, seconds from the step's start.
    pub stage_end: Vec<f64>,
    /// 1 - (time the stages computed) / (stages x the schedule's makespan).
    pub bubble: f64,
    /// (P-1)/(M+P-1): the bubble of equal stages and free messages.
    pub ideal_bubble: f64,
}

/// The seconds, and the label, of communication op `id` of `g` for `cfg`'s workers on
/// `links`; `rows`: the expected rows of slices all-gathered (as
/// [`distc_runtime::run::memory::expected_rows`] gives them).
fn comm_seconds(
    g: &Graph,
    id: NodeId,
    cfg: &StrategyConfig,
    links: &Links,
    rows: &HashMap<NodeId, usize>,
) -> (f64, f64, Option<(f64, f64)>, &'static str) {
    let n = cfg.data_workers().max(1);
    // On a mesh a data group's ranks are T x P apart (worker w is at data rank
    // w / (T P)): a node of L holds L / (T P) of them, at least one.
    let stride = cfg.model.max(1) * cfg.pipeline.max(1);
    let local = match cfg.ranks_per_node {
        0 => 0,
        l => (l / stride).max(1),
    };
    let nodes = if local > 0 { n / local.min(n) } else { n };
    // A model group (T consecutive workers) stays within a node when T divides L.
    let parts = cfg.model.max(1);
    let model_across = cfg.ranks_per_node < parts || !cfg.ranks_per_node.is_multiple_of(parts);
    let tf = parts as f64;
    // A ring over every worker crosses nodes whenever there is more than one.
    let across = local <= 1 || nodes > 1;
    let msg = |inter: bool, bytes: f64| links.message(inter, bytes);
    let node = g.node(id);
    let in_bytes = node
        .inputs
        .first()
        .map_or(0.0, |v| g.value_type(*v).bytes() as f64);
    let out_bytes = node.outputs.first().map_or(0.0, |t| t.bytes() as f64);
    let nf = n as f64;
    match g.op(id) {
        Op::AllReduce { ranks_per_node, .. } => {
            let (flat, hier) = all_reduce_seconds_by(in_bytes, n, local, msg);
            let both = (local > 1 && nodes > 1).then_some((flat, hier));
            if *ranks_per_node > 1 {
                (hier, in_bytes, both, "hierarchical")
            } else {
                (flat, in_bytes, both, "flat")
            }
        }
        Op::AllGather { workers, .. } => {
            // A worker's slice: its expected rows, else the static bound.
            let slice = match (rows.get(&id), node.outputs.first()) {
                (Some(r), Some(ValueType::IndexedSlices { dense, .. })) => {
                    let row: usize = dense.dims().iter().skip(1).product();
                    (*r as f64 / (*workers).max(1) as f64)
                        * (row as f64 * dense.dtype.size() as f64 + INDEX_BYTES)
                }
                _ => in_bytes,
            };
            let t = (nf - 1.0) * msg(across, slice);
            (t, slice, None, "ring")
        }
        Op::ReduceScatter { .. } => {
            let t = (nf - 1.0) * msg(across, in_bytes / nf);
            (t, in_bytes, None, "ring")
        }
        Op::AllGatherDense { .. } => {
            let t = (nf - 1.0) * msg(across, out_bytes / nf);
            (t, out_bytes, None, "ring")
        }
        // The model axis: rings over its T workers.
        Op::ModelAllReduce { .. } => {
            let t = 2.0 * (tf - 1.0) * msg(model_across, in_bytes / tf);
            (t, in_bytes, None, "model ring")
        }
        Op::ModelGather { .. } => {
            let t = (tf - 1.0) * msg(model_across, out_bytes / tf);
            (t, out_bytes, None, "model ring")
        }
        Op::ModelReduceScatter { .. } => {
            let t = (tf - 1.0) * msg(model_across, in_bytes / tf);
            (t, in_bytes, None, "model ring")
        }
        Op::Broadcast { .. } => {
            // Pipelined along the ring: one message's time, then a latency a hop.
            let t = msg(across, in_bytes) + (nf - 2.0).max(0.0) * msg(across, 0.0);
            (t, in_bytes, None, "ring")
        }
        op => {
            // A server's link carries every worker's share of what it holds: N/S times
            // a worker's bytes when the workers outnumber the servers.
            let bytes = match op {
                Op::Pull { .. } | Op::SparsePull { .. } => out_bytes,
                _ => in_bytes,
            };
            let fan_in = (nf / cfg.servers.max(1) as f64).max(1.0);
            let t = msg(true, bytes * fan_in);
            (t, bytes, None, "servers")
        }
    }
}

/// Replays one step of pipelined plan `pp` for `cfg`'s workers on `links`, with op
/// times from `profile`: each stage's forward and backward priced op by op (its
/// model-axis collectives on the worker's thread), the schedule run with messages
/// between adjacent stages on the link between nodes when a replica's T x P workers do
/// not fit in one node (within one otherwise), and then each stage's collectives among
/// its replicas (its gradients are ready only at its last backward) and its update.
/// The step is the last stage's to finish.
///
/// Where the workers share a node's cores ([`ComputeProfile::cores`]), the stages are
/// not all busy at once: the schedule is first replayed with each worker alone, and
/// then again with each op slowed by the workers its own stage's work overlaps, on
/// average, `1 + (L - 1) (1 - bubble)` of the node's L (the bubble of the first
/// replay).
pub fn simulate_pipeline(
    pp: &distc_ir::pipeline::PipelineProgram,
    single: &Graph,
    cfg: &StrategyConfig,
    links: Links,
    profile: &ComputeProfile,
    memory_per_worker: u128,
) -> Result<Simulation, String> {
    let replay = |links: Links, sharing: Sharing| {
        replay_pipeline(pp, single, cfg, links, profile, memory_per_worker, sharing)
    };
    let all = Sharing::all_busy(cfg);
    if profile.cores.is_none() || all.busy <= 1.0 {
        return replay(links, all);
    }
    let first = replay(links.clone(), Sharing { busy: 1.0, ..all })?;
    let bubble = first.pipeline.as_ref().map_or(0.0, |p| p.bubble);
    let busy = 1.0 + (all.busy - 1.0) * (1.0 - bubble).clamp(0.0, 1.0);
    replay(links, Sharing { busy, ..all })
}

/// One replay of [`simulate_pipeline`] with the node's cores shared as `sharing` says.
fn replay_pipeline(
    pp: &distc_ir::pipeline::PipelineProgram,
    single: &Graph,
    cfg: &StrategyConfig,
    links: Links,
    profile: &ComputeProfile,
    memory_per_worker: u128,
    sharing: Sharing,
) -> Result<Simulation, String> {
    use distc_ir::pipeline::schedule;
    let no_rows = HashMap::new();
    let stages = pp.stages.len();
    let mut counts = (0, 0, 0);
    // (compute seconds, blocking model-axis seconds, replica collectives).
    let mut price = |g: &Graph| {
        let (mut compute, mut model, mut tail) = (0.0, 0.0, Vec::new());
        for id in g.topo_order() {
            let op = g.op(id);
            if op.is_model_collective() {
                model += comm_seconds(g, id, cfg, &links, &no_rows).0;
            } else if op.is_collective() {
                tail.push(id);
            } else if !op.is_communication() {
                let (t, how) = profile.shared_op_seconds(g, id, sharing);
                tally(&mut counts, how);
                compute += t;
            }
        }
        (compute, model, tail)
    };
    let priced: Vec<_> = pp
        .stages
        .iter()
        .map(|st| (price(&st.forward), price(&st.backward)))
        .collect();
    let forward: Vec<f64> = priced.iter().map(|(f, _)| f.0 + f.1).collect();
    let backward: Vec<f64> = priced.iter().map(|(_, b)| b.0 + b.1).collect();
    // What one micro-batch sends to stage `to` from graph `g`.
    let sent = |g: &Graph, to: usize| -> f64 {
        g.node_ids()
            .into_iter()
            .filter(|&id| matches!(g.op(id), Op::Send { stage, .. } if *stage == to))
            .filter_map(|id| {
                g.node(id)
                    .inputs
                    .first()
                    .map(|v| g.value_type(*v).bytes() as f64)
            })
            .sum()
    };
    let replica = cfg.model.max(1) * stages;
    let across = cfg.ranks_per_node < replica;
    let activation_message: Vec<f64> = (0..stages.saturating_sub(1))
        .map(|s| links.point_to_point(across, sent(&pp.stages[s].forward, s + 1)))
        .collect();
    let gradient_message: Vec<f64> = (0..stages.saturating_sub(1))
        .map(|s| links.point_to_point(across, sent(&pp.stages[s + 1].backward, s)))
        .collect();
    let programs = pp.programs().map_err(|e| e.to_string())?;
    let transfer = |from: usize, to: usize| {
        if to == from + 1 {
            activation_message.get(from).copied().unwrap_or(0.0)
        } else if from == to + 1 {
            gradient_message.get(to).copied().unwrap_or(0.0)
        } else {
            0.0
        }
    };
    let sched = schedule::simulate_with_transfers(&programs, &forward, &backward, &transfer)
        .map_err(|e| e.to_string())?;
    let mut comms = Vec::new();
    let mut stage_end = Vec::with_capacity(stages);
    let mut comm_total = vec![0.0f64; stages];
    for (s, (st, (_, (_, _, tail)))) in pp.stages.iter().zip(&priced).enumerate() {
        // The stage's last computation is its last backward.
        let last = sched.timeline[s]
            .last()
            .map_or(0.0, |(start, _)| start + backward[s]);
        let mut at = last;
        for &id in tail {
            let (seconds, bytes, both, how) = comm_seconds(&st.backward, id, cfg, &links, &no_rows);
            comms.push(CommOp {
                node: format!("s{s}/{id}"),
                op: st.backward.op(id).mnemonic().into(),
                bytes,
                seconds,
                flat_seconds: both.map(|b| b.0),
                hierarchical_seconds: both.map(|b| b.1),
                how: how.into(),
                start: at,
                end: at + seconds,
            });
            at += seconds;
            comm_total[s] += seconds;
        }
        stage_end.push(at + profile.update_seconds(&st.backward, sharing));
    }
    let step = stage_end.iter().copied().fold(0.0, f64::max);
    // The worker of the stage that ends the step.
    let c = stage_end.iter().enumerate().fold(
        0,
        |best, (s, &e)| if e > stage_end[best] { s } else { best },
    );
    let m = pp.micro_batches as f64;
    let (f, b) = &priced[c];
    let optimizer = profile.update_seconds(&pp.stages[c].backward, sharing);
    let compute = m * (f.0 + b.0) + optimizer;
    let messages = |s: usize| {
        let before = if s > 0 {
            activation_message[s - 1] + gradient_message[s - 1]
        } else {
            0.0
        };
        let after = activation_message
            .get(s)
            .map_or(0.0, |a| a + gradient_message[s]);
        m * (before + after)
    };
    let comm = m * (f.1 + b.1) + comm_total[c] + messages(c);
    // What the worker waited beyond its computing that the bubble does not explain.
    let idle = sched.makespan - m * (forward[c] + backward[c]);
    let exposed = (step - compute - idle).clamp(0.0, comm);
    let single_step = profile.one_device_step(single);
    Ok(Simulation {
        workers: cfg.workers,
        servers: 0,
        server_comm: 0.0,
        ranks_per_node: cfg.ranks_per_node,
        links,
        step,
        compute,
        comm,
        exposed_comm: exposed,
        overlap: if comm > 0.0 {
            (1.0 - exposed / comm).clamp(0.0, 1.0)
        } else {
            1.0
        },
        single_step,
        scaling_efficiency: scaling_efficiency(single_step, step, cfg, pp.micro_batches),
        memory_per_worker,
        op_times: counts,
        comms,
        pipeline: Some(PipelineSimulation {
            stages,
            micro_batches: pp.micro_batches,
            schedule: pp.schedule.to_string(),
            forward,
            backward,
            activation_message,
            gradient_message,
            stage_end,
            bubble: sched.bubble,
            ideal_bubble: schedule::predicted_bubble(stages, pp.micro_batches),
        }),
    })
}

/// Ops a worker's thread waits for itself: a pull answers before the program goes on.
fn blocking(op: &Op) -> bool {
    matches!(op, Op::Pull { .. } | Op::SparsePull { .. })
}

/// Replays one step of worker program `g` for `cfg`'s workers on `links`, with op times
/// from `profile`; `single` is the one-device program of the same model and batch (for
/// the scaling efficiency), `memory_per_worker` what the caller estimated.
pub fn simulate(
    g: &Graph,
    single: &Graph,
    cfg: &StrategyConfig,
    links: Links,
    profile: &ComputeProfile,
    rows: &HashMap<NodeId, usize>,
    memory_per_worker: u128,
) -> Simulation {
    let mut done: HashMap<NodeId, f64> = HashMap::new();
    let (mut clock, mut comm_free, mut compute, mut waited, mut comm) =
        (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut counts = (0, 0, 0);
    let mut comms = Vec::new();
    // Every worker computes its step at once (no pipeline bubbles).
    let sharing = Sharing::all_busy(cfg);
    for id in g.topo_order() {
        let node = g.node(id);
        let ready = node
            .inputs
            .iter()
            .map(|v| done.get(&v.node).copied().unwrap_or(0.0))
            .fold(0.0, f64::max);
        if node.op.is_communication() {
            let (seconds, bytes, both, how) = comm_seconds(g, id, cfg, &links, rows);
            let start = if blocking(&node.op) {
                // The worker's thread is the one waiting.
                let s = clock.max(ready);
                waited += s + seconds - clock;
                clock = s + seconds;
                s
            } else {
                let s = ready.max(comm_free).max(clock);
                comm_free = s + seconds;
                s
            };
            comm += seconds;
            done.insert(id, start + seconds);
            comms.push(CommOp {
                node: id.to_string(),
                op: node.op.mnemonic().into(),
                bytes,
                seconds,
                flat_seconds: both.map(|b| b.0),
                hierarchical_seconds: both.map(|b| b.1),
                how: how.into(),
                start,
                end: start + seconds,
            });
        } else {
            let (t, how) = profile.shared_op_seconds(g, id, sharing);
            tally(&mut counts, how);
            if ready > clock {
                waited += ready - clock;
                clock = ready;
            }
            clock += t;
            compute += t;
            done.insert(id, clock);
        }
    }
    // The step's last collectives (a sink reads nothing back) end it too.
    let end = done.values().copied().fold(clock, f64::max);
    waited += end - clock;
    let optimizer = profile.update_seconds(g, sharing);
    let step = end + optimizer;
    let single_step = profile.one_device_step(single);
    let server_comm = comms
        .iter()
        .filter(|c| c.how == "servers")
        .map(|c| c.seconds)
        .sum();
    Simulation {
        workers: cfg.workers,
        servers: cfg.servers,
        server_comm,
        ranks_per_node: cfg.ranks_per_node,
        links,
        step,
        compute: compute + optimizer,
        comm,
        exposed_comm: waited,
        overlap: if comm > 0.0 { 1.0 - waited / comm } else { 1.0 },
        single_step,
        scaling_efficiency: scaling_efficiency(single_step, step, cfg, 1),
        memory_per_worker,
        op_times: counts,
        comms,
        pipeline: None,
    }
}

/// The scaling efficiency per worker: a step does `micro` one-device batches of work
/// for its T x P workers of a replica (T model ranks share a batch, P stages a
/// micro-batch), against one device's step.
fn scaling_efficiency(single_step: f64, step: f64, cfg: &StrategyConfig, micro: usize) -> f64 {
    let share = (cfg.model.max(1) * cfg.pipeline.max(1)) as f64;
    if step > 0.0 {
        single_step * micro as f64 / (share * step)
    } else {
        1.0
    }
}

/// Counts an op's time by where it came from: (measured, scaled, priced as a copy).
fn tally(counts: &mut (usize, usize, usize), how: &str) {
    match how {
        "measured" => counts.0 += 1,
        "scaled" => counts.1 += 1,
        "copy" => counts.2 += 1,
        _ => {}
    }
}

impl Simulation {
    /// Why the servers bound the step, if they do: their links' time is over half of
    /// it and each server serves several workers, which more servers would share.
    pub fn servers_note(&self) -> Option<String> {
        (self.servers > 0 && self.workers > self.servers && self.server_comm > 0.5 * self.step)
            .then(|| {
                format!(
                    "note: the {} parameter server(s) are the bottleneck: each link carries \
                     the pulls and pushes of {:.0} workers, {:.3} ms of the {:.3} ms step; \
                     simulate more servers with --servers N",
                    self.servers,
                    self.workers as f64 / self.servers as f64,
                    self.server_comm * 1e3,
                    self.step * 1e3
                )
            })
    }

    /// A summary and one line per communication op.
    pub fn render(&self, plan: &Plan, profile: &ComputeProfile) -> String {
        let ms = |s: f64| s * 1e3;
        let nodes = if self.ranks_per_node > 0 {
            format!(
                " in {} nodes of {}",
                self.workers / self.ranks_per_node.max(1),
                self.ranks_per_node
            )
        } else {
            String::new()
        };
        let servers = match self.servers {
            0 => String::new(),
            1 => " and 1 server".into(),
            n => format!(" and {n} servers"),
        };
        let mut out = format!(
            "{} ({}) on {} workers{nodes}{servers}\nlinks: intra {:.3e} B/s {:.2e} s, inter {:.3e} B/s \
             {:.2e} s\ncompute: {} ({} ops measured, {} scaled from another size, {} priced \
             as copies)\n",
            plan.model,
            plan.strategy.name(),
            self.workers,
            self.links.intra.bandwidth,
            self.links.intra.latency,
            self.links.inter.bandwidth,
            self.links.inter.latency,
            profile.source,
            self.op_times.0,
            self.op_times.1,
            self.op_times.2,
        );
        out += &format!(
            "step {:.3} ms: compute {:.3} ms, communication {:.3} ms of which {:.3} ms \
             exposed (overlap {:.1}%)\none device {:.3} ms a step: scaling efficiency \
             {:.1}%\nmemory per worker {}\n",
            ms(self.step),
            ms(self.compute),
            ms(self.comm),
            ms(self.exposed_comm),
            100.0 * self.overlap,
            ms(self.single_step),
            100.0 * self.scaling_efficiency,
            distc_runtime::run::memory::gib(self.memory_per_worker),
        );
        if let Some(note) = self.servers_note() {
            out += &note;
            out.push('\n');
        }
        if let Some(p) = &self.pipeline {
            out += &format!(
                "pipeline: {} stages x {} micro-batches ({}): bubble {:.1}% ((P-1)/(M+P-1) = \
                 {:.1}%)\n{:<6} {:>10} {:>10} {:>14} {:>14} {:>10}\n",
                p.stages,
                p.micro_batches,
                p.schedule,
                100.0 * p.bubble,
                100.0 * p.ideal_bubble,
                "stage",
                "fwd ms",
                "bwd ms",
                "act msg ms",
                "grad msg ms",
                "ends ms"
            );
            for s in 0..p.stages {
                let msg = |v: &[f64]| {
                    v.get(s)
                        .map_or("-".to_string(), |x| format!("{:.3}", ms(*x)))
                };
                out += &format!(
                    "{:<6} {:>10.3} {:>10.3} {:>14} {:>14} {:>10.3}\n",
                    s,
                    ms(p.forward[s]),
                    ms(p.backward[s]),
                    msg(&p.activation_message),
                    msg(&p.gradient_message),
                    ms(p.stage_end[s])
                );
            }
        }
        if !self.comms.is_empty() {
            out += &format!(
                "{:<8} {:<16} {:>12} {:>13} {:>10} {:>10} {:>10} {:>10}\n",
                "node", "op", "bytes", "how", "ms", "flat ms", "hier ms", "start ms"
            );
            for c in &self.comms {
                let opt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.3}", ms(x)));
                out += &format!(
                    "{:<8} {:<16} {:>12.0} {:>13} {:>10.3} {:>10} {:>10} {:>10.3}\n",
                    c.node,
                    c.op,
                    c.bytes,
                    c.how,
                    ms(c.seconds),
                    opt(c.flat_seconds),
                    opt(c.hierarchical_seconds),
                    ms(c.start)
                );
            }
        }
        out
    }
}

/// The one-device program of the plan's model and batch.
pub fn single_program(
    plan: &Plan,
    data_dir: Option<&std::path::Path>,
) -> Result<crate::Compiled, String> {
    let single = StrategyConfig {
        strategy: distc_passes::placement::Strategy::Single,
        workers: 1,
        servers: 0,
        sync: distc_passes::placement::SyncMode::Sync,
        zero: 0,
        ranks_per_node: 0,
        grad_wire: distc_passes::placement::Precision::Fp32,
        // One device: no model axis, no stages.
        model: 1,
        pipeline: 1,
        micro_batches: 1,
        ..plan.settings.clone()
    };
    let opts = crate::CompileOptions {
        batch: Some(plan.config.batch),
        strategy: single,
        data_dir: data_dir.map(std::path::Path::to_path_buf),
        ..Default::default()
    };
    crate::compile_file(std::path::Path::new(&plan.source), &opts)
        .map_err(|e| format!("compiling {} for one device: {e}", plan.source))
}

/// Profiles `single` (the plan's model on one device) on this machine's CPU for
/// `steps` steps, the first ones (allocation, first touches) left out.
pub fn profile_here(
    single: &crate::Compiled,
    steps: usize,
    data_dir: Option<&std::path::Path>,
    copy_bandwidth: f64,
) -> Result<ComputeProfile, String> {
    let opts = distc_runtime::run::train::TrainOptions {
        steps: Some(steps.max(2)),
        data_dir: data_dir.map(std::path::Path::to_path_buf),
        global_data: true,
        trace: true,
        evaluate: false,
        ..Default::default()
    };
    // Through the one launch entry, so the run is checked (settings, data, memory) as
    // `distc run` checks it.
    let run = Launch {
        programs: single.programs(1),
        config: &single.config,
        opts,
        device: DeviceChoice::Cpu,
        transport: TransportChoice::InProcess,
        rows_touched: crate::verify::rows_touched(single.dist.as_ref()),
    };
    let report = launch(&run, &mut |_| Ok(()))
        .map_err(|e| format!("the profiling run: {e}"))?
        .ok_or("the profiling run: an in-process run gave no report")?;
    let first = report.spans.iter().map(|s| s.step).min().unwrap_or(0);
    let skip = if steps >= 4 { 2 } else { 1 };
    ComputeProfile::from_spans(
        &single.programs.worker,
        &report.spans,
        first + skip,
        copy_bandwidth,
        format!(
            "one worker profiled on this machine's CPU ({} steps, the first {skip} left out)",
            steps.max(2)
        ),
    )
}

/// The spans of the trace file at `path` (`distc train|run --trace`).
pub fn read_trace(path: &std::path::Path) -> Result<Vec<Span>, String> {
    let text = distc_runtime::core::output::read_regular_text(
        path,
        distc_runtime::core::output::TEXT_INPUT_LIMIT,
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    distc_runtime::run::trace::spans_of_chrome_trace(&text)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The op times of `g` from `spans`, the trace at `path` of a run of `g` (checked by
/// the caller with [`check_spans_of`]), saying whose clock timed them: a GPU's trace
/// times each op's kernels between events on its stream, a CPU's on the host.
pub fn profile_of_trace(
    g: &Graph,
    spans: &[Span],
    path: &std::path::Path,
    copy_bandwidth: f64,
) -> Result<ComputeProfile, String> {
    let clock = if spans.iter().any(|s| s.on_device) {
        "each op's kernels timed on the device"
    } else {
        "each op timed by the host"
    };
    ComputeProfile::from_trace(
        g,
        spans,
        copy_bandwidth,
        format!("worker 0 of the run traced in {} ({clock})", path.display()),
    )
    .map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether a span of a node is its kernel's: not the worker's wait for a collective,
/// not the issuing of one (whose time is the link model's).
fn is_op_span(s: &Span) -> bool {
    s.node.is_some() && !s.name.starts_with("wait ") && !s.name.starts_with("issue ")
}

/// Whether `spans` are of a run of `g`: every op span of worker 0 names a node of `g`
/// of its op and of its input and output types, and some do. Node ids and op names
/// repeat between models (every MLP has a `%5 = matmul`); the types tell them apart.
/// Else the error names the first span that differs, and how.
pub fn check_spans_of(g: &Graph, spans: &[Span]) -> Result<(), String> {
    let nodes: HashMap<String, NodeId> = g
        .node_ids()
        .into_iter()
        .map(|id| (id.to_string(), id))
        .collect();
    let mut any = false;
    for s in spans.iter().filter(|s| s.track == "worker 0") {
        let Some(node) = s.node.as_ref().filter(|_| is_op_span(s)) else {
            continue;
        };
        let Some(&id) = nodes.get(node) else {
            return Err(format!(
                "the trace's {node} (`{}`) is no node of the program",
                s.name
            ));
        };
        let op = g.op(id).mnemonic();
        if op != s.name {
            return Err(format!(
                "the trace's {node} is a `{}`, the program's a `{op}`",
                s.name
            ));
        }
        let types = distc_runtime::run::trace::node_types(g, id);
        match &s.types {
            None => {
                return Err(format!(
                    "the trace's {node} (`{op}`) has no types (a trace from an older \
                     distc: trace the run again)"
                ))
            }
            Some(t) if *t != types => {
                return Err(format!(
                    "the trace's {node} (`{op}`) is {t}, the program's {types}"
                ))
            }
            Some(_) => {}
        }
        any = true;
    }
    if any {
        Ok(())
    } else {
        Err("the trace holds no op of worker 0".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distc_passes::placement::Strategy;

    const MODEL: &str = "model m {
  input x: f32[B, 64]
  input label: i32[B]
  param w1: f32[64, 256] = glorot
  param b1: f32[256] = zeros
  param w2: f32[256, 256] = glorot
  param w3: f32[256, 10] = glorot
  minimize softmax_cross_entropy(relu(relu(x @ w1 + b1) @ w2) @ w3, label)
}
train {
  data = gaussian_classes(features = 64, classes = 10)
  batch = 8
  optimizer = sgd(lr = 0.1)
  steps = 4
  seed = 1
}";

    fn compiled(cfg: &StrategyConfig) -> crate::Compiled {
        let opts = crate::CompileOptions {
            strategy: cfg.clone(),
            ..Default::default()
        };
        crate::compile("m.dsl", MODEL, &opts).expect("compiles")
    }

    fn allreduce(workers: usize, local: usize, bucket_mb: f64) -> StrategyConfig {
        StrategyConfig {
            strategy: Strategy::Allreduce,
            workers,
            ranks_per_node: local,
            bucket_mb,
            first_bucket_mb: bucket_mb,
            ..Default::default()
        }
    }

    /// Every op priced as a copy at 1 GB/s, the optimizer at 1 ns a byte.
    fn profile() -> ComputeProfile {
        ComputeProfile {
            copy_bandwidth: 1e9,
            optimizer_per_byte: 1e-9,
            ..Default::default()
        }
    }

    fn run(cfg: &StrategyConfig, links: Links) -> Simulation {
        let c = compiled(cfg);
        let single = compiled(&StrategyConfig::default());
        simulate(
            &c.programs.worker,
            &single.programs.worker,
            cfg,
            links,
            &profile(),
            &HashMap::new(),
            0,
        )
    }

    fn link(bandwidth: f64, latency: f64) -> Link {
        Link { bandwidth, latency }
    }

    #[test]
    fn the_fit_recovers_the_link_that_made_the_samples() {
        let truth = link(3e9, 40e-6);
        let samples = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
            .iter()
            .map(|&b| Sample {
                bytes: b,
                seconds: ring_all_reduce(b as f64, 4, truth),
            })
            .collect();
        let c = Calibration::fit("inprocess", 4, 1, samples, 1e10).expect("the test's own input");
        assert!(
            (c.link.bandwidth / truth.bandwidth - 1.0).abs() < 1e-9,
            "{:?}",
            c.link
        );
        assert!(
            (c.link.latency / truth.latency - 1.0).abs() < 1e-9,
            "{:?}",
            c.link
        );
        for (s, p) in c.samples.iter().zip(&c.predicted) {
            assert!((p / s.seconds - 1.0).abs() < 1e-9);
        }
        assert!(Calibration::fit("inprocess", 1, 1, c.samples.clone(), 1e10).is_err());
    }

    #[test]
    fn a_fit_needs_two_distinct_sizes_and_measured_steps_come_smallest_first() {
        let sample = |bytes, seconds| Sample { bytes, seconds };
        let e = Calibration::fit("inprocess", 2, 1, vec![sample(4, 1e-5); 3], 1e10)
            .expect_err("one size thrice");
        assert!(e.contains("4 bytes is given more than once"), "{e}");
        // Sizes given largest first: interpolated between the right neighbours.
        let c = Calibration::fit(
            "inprocess",
            2,
            1,
            vec![
                sample(1 << 20, 1e-3),
                sample(1 << 16, 1e-4),
                sample(1 << 12, 1e-5),
            ],
            1e10,
        )
        .expect("the test's own input");
        let steps = c.ring_steps();
        assert!(steps.windows(2).all(|w| w[0].0 < w[1].0), "{steps:?}");
        let mut links = Links::new(c.link, c.link);
        links.inter_measured = steps.clone();
        let mid = links.message(true, (steps[0].0 + steps[1].0) / 2.0);
        assert!(
            (mid - (steps[0].1 + steps[1].1) / 2.0).abs() < 1e-15,
            "{mid}"
        );
    }

    #[test]
    fn a_trace_matches_a_program_by_op_and_types_and_names_the_first_op_that_differs() {
        let c = compiled(&StrategyConfig::default());
        let g = &c.programs.worker;
        let id = g
            .topo_order()
            .into_iter()
            .find(|id| g.op(*id).mnemonic() == "matmul")
            .expect("the test's own input");
        let span = |types: Option<String>| Span {
            track: "worker 0".into(),
            name: "matmul".into(),
            node: Some(id.to_string()),
            types,
            step: 1,
            bytes: None,
            start_us: 0.0,
            dur_us: 1.0,
            counters: Vec::new(),
            on_device: false,
        };
        let own = distc_runtime::run::trace::node_types(g, id);
        assert_eq!(check_spans_of(g, &[span(Some(own.clone()))]), Ok(()));
        let other = own.replace("64", "32");
        let e = check_spans_of(g, &[span(Some(other.clone()))]).expect_err("other types");
        assert_eq!(
            e,
            format!("the trace's {id} (`matmul`) is {other}, the program's {own}")
        );
        let e = check_spans_of(g, &[span(None)]).expect_err("no types");
        assert!(e.contains("has no types"), "{e}");
        assert!(check_spans_of(g, &[]).is_err());
    }

    #[test]
    fn a_calibrated_link_gives_back_its_measurements_and_interpolates_between_them() {
        let samples: Vec<Sample> = [(1 << 16, 2e-3), (1 << 20, 0.1), (1 << 22, 0.9)]
            .iter()
            .map(|&(bytes, seconds)| Sample { bytes, seconds })
            .collect();
        let c = Calibration::fit("mpi", 3, 3, samples, 1e10).expect("the test's own input");
        let mut links = Links::new(link(100e9, 5e-6), c.link);
        links.inter_measured = c.ring_steps();
        // An all-reduce of a measured size over the measured ranks takes what it took.
        for s in &c.samples {
            let t = 2.0 * 2.0 * links.message(true, s.bytes as f64 / 3.0);
            assert!((t / s.seconds - 1.0).abs() < 1e-9, "{t} vs {s:?}");
        }
        let steps = c.ring_steps();
        let mid = links.message(true, (steps[0].0 + steps[1].0) / 2.0);
        assert!((mid - (steps[0].1 + steps[1].1) / 2.0).abs() < 1e-12);
        // Beyond the largest: on at the fitted bandwidth.
        let last = steps[2];
        let beyond = links.message(true, last.0 + 1e6);
        assert!((beyond - last.1 - 1e6 / c.link.bandwidth).abs() < 1e-12);
        // The other link was given as a line.
        assert_eq!(links.message(false, 1e6), 5e-6 + 1e6 / 100e9);
    }

    #[test]
    fn measured_messages_price_a_pipelines_messages_and_are_checked_as_samples() {
        let samples: Vec<Sample> = [(1 << 16, 2e-3), (1 << 20, 0.1)]
            .iter()
            .map(|&(bytes, seconds)| Sample { bytes, seconds })
            .collect();
        let mut c = Calibration::fit("mpi", 3, 3, samples, 1e10).expect("the test's own input");
        c.messages = vec![
            Sample {
                bytes: 1 << 20,
                seconds: 0.02,
            },
            Sample {
                bytes: 1 << 16,
                seconds: 1e-3,
            },
        ];
        c.check().expect("messages in range");
        let links = Links::new(link(100e9, 5e-6), c.link).with_measured(&MeasuredSteps {
            inter: c.ring_steps(),
            inter_messages: c.message_times(),
            ..Default::default()
        });
        // A measured size takes what it took; between two, the interpolation.
        assert_eq!(links.point_to_point(true, (1 << 20) as f64), 0.02);
        let mid = links.point_to_point(true, ((1 << 16) + (1 << 20)) as f64 / 2.0);
        assert!((mid - (1e-3 + 0.02) / 2.0).abs() < 1e-12);
        // A ring step of the same bytes is another thing; a link without measured
        // messages prices them as a ring step.
        assert_ne!(links.message(true, (1 << 20) as f64), 0.02);
        assert_eq!(links.point_to_point(false, 1e6), links.message(false, 1e6));
        c.messages[1].seconds = -1.0;
        let e = c.check().expect_err("a negative time");
        assert!(e.contains("`messages[1].seconds` -1.0"), "{e}");
        c.messages.truncate(1);
        let e = c.check().expect_err("one size");
        assert!(e.contains("`messages`: 1 buffer size"), "{e}");
    }

    #[test]
    fn a_free_network_costs_nothing_and_the_step_is_the_one_device_step() {
        let s = run(
            &allreduce(8, 0, 25.0),
            Links::new(link(1e30, 0.0), link(1e30, 0.0)),
        );
        assert!(!s.comms.is_empty());
        assert!(s.exposed_comm < 1e-12, "{s:?}");
        // The worker's program computes what one device computes, plus packing.
        assert!(s.compute >= s.single_step, "{s:?}");
        assert!(
            s.scaling_efficiency > 0.5 && s.scaling_efficiency <= 1.0,
            "{s:?}"
        );
    }

    #[test]
    fn the_step_is_compute_plus_the_waits_and_overlap_is_what_was_hidden() {
        for bucket in [0.0, 0.1, 25.0] {
            let s = run(
                &allreduce(16, 0, bucket),
                Links::new(link(100e9, 5e-6), link(1e8, 50e-6)),
            );
            assert!((s.step - s.compute - s.exposed_comm).abs() < 1e-12, "{s:?}");
            assert!(s.exposed_comm <= s.comm + 1e-12, "{s:?}");
            let busy: f64 = s.comms.iter().map(|c| c.end - c.start).sum();
            assert!((busy - s.comm).abs() < 1e-12);
            // One communication thread: no two collectives at once.
            for w in s.comms.windows(2) {
                assert!(w[1].start >= w[0].end - 1e-15, "{:?}", s.comms);
            }
        }
        // Small buckets start while the backward pass runs: some of it is hidden.
        let s = run(
            &allreduce(16, 0, 0.0),
            Links::new(link(100e9, 5e-6), link(1e9, 5e-6)),
        );
        assert!(s.comms.len() > 1 && s.overlap > 0.0, "{s:?}");
    }

    #[test]
    fn a_slow_link_between_nodes_makes_buckets_hierarchical_and_the_step_faster() {
        let links = Links::new(link(100e9, 5e-6), link(1e9, 100e-6));
        let hier = run(&allreduce(64, 8, 25.0), links.clone());
        let flat = run(&allreduce(64, 0, 25.0), links);
        let reduces: Vec<&CommOp> = hier.comms.iter().filter(|c| c.op == "all_reduce").collect();
        assert!(!reduces.is_empty());
        for c in reduces {
            assert_eq!(c.how, "hierarchical", "{c:?}");
            let (f, h) = (
                c.flat_seconds.expect("the test's own input"),
                c.hierarchical_seconds.expect("the test's own input"),
            );
            assert!(h < f && c.seconds == h, "{c:?}");
        }
        assert!(hier.step < flat.step, "{} vs {}", hier.step, flat.step);
        assert!(flat.comms.iter().all(|c| c.how != "hierarchical"));
    }

    #[test]
    fn op_times_come_from_the_same_op_then_the_same_kind_then_a_copy() {
        let c = compiled(&StrategyConfig::default());
        let g = &c.programs.worker;
        let matmuls: Vec<NodeId> = g
            .topo_order()
            .into_iter()
            .filter(|id| g.op(*id).mnemonic() == "matmul")
            .collect();
        let spans: Vec<Span> = [1u64, 2, 3]
            .iter()
            .map(|&step| Span {
                track: "worker 0".into(),
                name: "matmul".into(),
                node: Some(matmuls[0].to_string()),
                types: Some(distc_runtime::run::trace::node_types(g, matmuls[0])),
                step,
                bytes: None,
                start_us: 0.0,
                dur_us: 10.0 * step as f64,
                counters: Vec::new(),
                on_device: false,
            })
            .collect();
        let p = ComputeProfile::from_spans(g, &spans, 2, 1e9, "test".into())
            .expect("the test's own input");
        // Steps 2 and 3: 20 and 30 us, the median of two is the later.
        let (t, how) = p.op_seconds(g, matmuls[0]);
        assert!((t - 30e-6).abs() < 1e-15 && how == "measured", "{t} {how}");
        let other = *matmuls
            .iter()
            .find(|id| signature(g, **id) != signature(g, matmuls[0]))
            .expect("the test's own input");
        let (t, how) = p.op_seconds(g, other);
        assert_eq!(how, "scaled");
        // A product scales with its FLOPs.
        let flops = distc_passes::cost::node_flops;
        assert!((t - 30e-6 * flops(g, other) / flops(g, matmuls[0])).abs() < 1e-15);
        let relu = g
            .topo_order()
            .into_iter()
            .find(|id| g.op(*id).mnemonic() == "relu")
            .expect("the test's own input");
        assert_eq!(
            p.op_seconds(g, relu),
            (elements(g, relu) * 4.0 / 1e9, "copy")
        );
        assert!(ComputeProfile::from_spans(g, &[], 0, 1e9, "empty".into()).is_err());
    }

    /// The seconds of `g`'s products and of its other ops, priced by `p` as `sharing`.
    fn products_and_others(p: &ComputeProfile, g: &Graph, sharing: Sharing) -> (f64, f64) {
        let (mut products, mut others) = (0.0, 0.0);
        for id in g.topo_order() {
            if g.op(id).is_communication() {
                continue;
            }
            let t = p.shared_op_seconds(g, id, sharing).0;
            if is_product(g.op(id)) {
                products += t;
            } else {
                others += t;
            }
        }
        (products, others)
    }

    fn sharing_cores(cores: usize, product_threads: usize) -> ComputeProfile {
        ComputeProfile {
            cores: Some(Cores {
                cores,
                product_threads,
            }),
            ..profile()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-9)
    }

    #[test]
    fn workers_sharing_a_nodes_cores_are_priced_by_how_many_compute_at_once() {
        let cfg = allreduce(4, 0, 25.0);
        let c = compiled(&cfg);
        let g = &c.programs.worker;
        let all = Sharing::all_busy(&cfg);
        assert_eq!(
            all,
            Sharing {
                busy: 4.0,
                workers: 4
            }
        );
        let (products, others) = products_and_others(&profile(), g, all);
        assert!(products > 0.0 && others > 0.0);
        // Four workers of one thread on two cores: every op twice as long.
        let (p, o) = products_and_others(&sharing_cores(2, 1), g, all);
        assert!(
            close(p, 2.0 * products) && close(o, 2.0 * others),
            "{p} {o}"
        );
        // Products on two threads each: eight threads on two cores.
        let (p, o) = products_and_others(&sharing_cores(2, 2), g, all);
        assert!(
            close(p, 4.0 * products) && close(o, 2.0 * others),
            "{p} {o}"
        );
        // Two workers a node: a core each, as the profile's worker had.
        let two = Sharing::all_busy(&allreduce(4, 2, 25.0));
        assert_eq!(two.busy, 2.0);
        let (p, o) = products_and_others(&sharing_cores(2, 1), g, two);
        assert!(close(p, products) && close(o, others), "{p} {o}");
        // The update: profiled alone on both cores (rayon), run on the worker's own
        // thread among four workers.
        let update = profile().update_seconds(g, all);
        assert!(update > 0.0);
        assert!(close(
            sharing_cores(2, 1).update_seconds(g, two),
            2.0 * update
        ));
        assert!(close(
            sharing_cores(2, 1).update_seconds(g, all),
            4.0 * update
        ));
        // The step is priced so: no communication is exposed on a free link.
        let single = compiled(&StrategyConfig::default());
        let free = Links::new(link(1e15, 0.0), link(1e15, 0.0));
        let step = |p: &ComputeProfile| {
            simulate(
                g,
                &single.programs.worker,
                &cfg,
                free.clone(),
                p,
                &HashMap::new(),
                0,
            )
            .compute
        };
        let alone = step(&profile());
        assert!(close(alone, products + others + update), "{alone}");
        let shared = step(&sharing_cores(2, 1));
        assert!(
            close(shared, 2.0 * (products + others) + 4.0 * update),
            "{shared}"
        );
    }

    #[test]
    fn a_pipelines_stages_share_the_cores_only_outside_its_bubble() {
        let cfg = StrategyConfig {
            pipeline: 2,
            micro_batches: 2,
            ..Default::default()
        };
        let c = compiled(&cfg);
        let pp = c.programs.pipeline.as_ref().expect("a pipeline");
        let single = compiled(&StrategyConfig::default());
        let free = Links::new(link(1e15, 0.0), link(1e15, 0.0));
        let sim = |p: &ComputeProfile| {
            simulate_pipeline(pp, &single.programs.worker, &cfg, free.clone(), p, 0)
                .expect("simulates")
                .pipeline
                .expect("a pipeline")
        };
        let alone = sim(&profile());
        assert!(alone.bubble > 0.1 && alone.bubble < 0.9, "{}", alone.bubble);
        // Two stages on one core: each op shares it with the other stage as long as
        // that one computes, 1 - bubble of the time.
        let shared = sim(&sharing_cores(1, 1));
        let factor = 2.0 - alone.bubble;
        for (a, s) in alone.forward.iter().zip(&shared.forward) {
            assert!(close(*s, factor * a), "{s} against {a} x {factor}");
        }
        // A core a stage: as alone.
        assert_eq!(sim(&sharing_cores(2, 1)).forward, alone.forward);
    }
}
