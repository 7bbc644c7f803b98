//! Algebraic simplification with egg, and common-subexpression elimination.
//!
//! The graph is loaded into an e-graph whose language holds the arithmetic and layout
//! subset of the ops (`add sub mul div neg transpose reshape`); every other op is an
//! opaque node keyed by its (op, result types), so identical computations on identical
//! inputs share one e-class: that is the CSE. Rules below state one identity each; the
//! smallest equivalent graph is extracted and rebuilt. Requires a verified graph;
//! preserves the value of every sink. Before/after:
//! ```text
//! %3 = mul %2, %1 : f32[4,8]   (%1 = constant{value=1.0} : f32[])
//! %4 = transpose{perm=[1,0]} %3
//! %5 = transpose{perm=[1,0]} %4          =>   output{name="y"} %2
//! output{name="y"} %5
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{infer, FusedStep, Graph, NodeId, Op, Shape, ValueId, ValueType};
use egg::{
    define_language, rewrite, Applier, DidMerge, Id, Language, PatternAst, Subst, Symbol, Var,
};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

define_language! {
    /// The subset of ops egg reasons about; the rest are `Other` nodes named `op<N>`.
    enum TensorLang {
        "add" = Add([Id; 2]),
        "sub" = Sub([Id; 2]),
        "mul" = Mul([Id; 2]),
        "div" = Div([Id; 2]),
        "neg" = Neg([Id; 1]),
        "transpose" = Transpose([Id; 2]),
        "reshape" = Reshape([Id; 2]),
        "port" = Port([Id; 2]),
        Attr(Symbol),
        Other(Symbol, Vec<Id>),
    }
}

/// What is known about an e-class: its type, and its value when it is a filled constant.
#[derive(Debug, Clone, PartialEq)]
struct Info {
    ty: Option<ValueType>,
    constant: Option<f64>,
}

/// The analysis carries the table of opaque ops.
#[derive(Default)]
struct Types {
    ops: Vec<(Op, Vec<ValueType>)>,
}

type EGraph = egg::EGraph<TensorLang, Types>;

fn dims_attr(s: Symbol) -> Option<Vec<usize>> {
    let body = s.as_str().split_once(':')?.1;
    if body.is_empty() {
        return Some(vec![]);
    }
    body.split(',').map(|x| x.parse().ok()).collect()
}

fn attr(kind: &str, v: &[usize]) -> Symbol {
    let body: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    Symbol::from(format!("{kind}:{}", body.join(",")))
}

fn opaque_index(s: Symbol) -> Option<usize> {
    s.as_str().strip_prefix("op")?.parse().ok()
}

/// The IR op an e-node stands for (None for attribute leaves and ports).
fn ir_op(egraph: &EGraph, node: &TensorLang) -> Option<Op> {
    let leaf = |id: Id| -> Option<Symbol> {
        egraph[id].nodes.iter().find_map(|n| match n {
            TensorLang::Attr(s) => Some(*s),
            _ => None,
        })
    };
    Some(match node {
        TensorLang::Add(_) => Op::Add,
        TensorLang::Sub(_) => Op::Sub,
        TensorLang::Mul(_) => Op::Mul,
        TensorLang::Div(_) => Op::Div,
        TensorLang::Neg(_) => Op::Neg,
        TensorLang::Transpose([p, _]) => Op::Transpose {
            perm: dims_attr(leaf(*p)?)?,
        },
        TensorLang::Reshape([s, _]) => Op::Reshape {
            shape: Shape(dims_attr(leaf(*s)?)?),
        },
        TensorLang::Other(s, _) => egraph.analysis.ops.get(opaque_index(*s)?)?.0.clone(),
        TensorLang::Port(_) | TensorLang::Attr(_) => return None,
    })
}

/// The children of an e-node that are tensor operands (attribute leaves excluded).
fn operands(node: &TensorLang) -> Vec<Id> {
    match node {
        TensorLang::Transpose([_, x]) | TensorLang::Reshape([_, x]) => vec![*x],
        TensorLang::Port([_, x]) => vec![*x],
        TensorLang::Attr(_) => vec![],
        n => n.children().to_vec(),
    }
}

impl egg::Analysis<TensorLang> for Types {
    type Data = Info;

    fn make(egraph: &mut EGraph, enode: &TensorLang, _id: Id) -> Info {
        let none = Info {
            ty: None,
            constant: None,
        };
        match enode {
            TensorLang::Attr(_) => none,
            TensorLang::Port([p, x]) => {
                let port = egraph[*p].nodes.iter().find_map(|n| match n {
                    TensorLang::Attr(s) => dims_attr(*s).and_then(|v| v.first().copied()),
                    _ => None,
                });
                let ty = egraph[*x].nodes.iter().find_map(|n| match n {
                    TensorLang::Other(s, _) => {
                        let (_, outs) = egraph.analysis.ops.get(opaque_index(*s)?)?;
                        outs.get(port?).cloned()
                    }
                    _ => None,
                });
                Info { ty, constant: None }
            }
            TensorLang::Other(s, _) => {
                match opaque_index(*s).and_then(|i| egraph.analysis.ops.get(i)) {
                    Some((op, outs)) => Info {
                        ty: (outs.len() == 1).then(|| outs[0].clone()),
                        constant: match op {
                            Op::Constant { value, .. } => Some(*value),
                            _ => None,
                        },
                    },
                    None => none,
                }
            }
            n => {
                let Some(op) = ir_op(egraph, n) else {
                    return none;
                };
                let tys: Option<Vec<ValueType>> = operands(n)
                    .iter()
                    .map(|c| egraph[*c].data.ty.clone())
                    .collect();
                let ty = tys.and_then(|t| {
                    let refs: Vec<&ValueType> = t.iter().collect();
                    infer(&op, &refs).ok().and_then(|mut o| o.pop())
                });
                Info { ty, constant: None }
            }
        }
    }

    fn merge(&mut self, a: &mut Info, b: Info) -> DidMerge {
        let mut changed = false;
        if a.ty.is_none() && b.ty.is_some() {
            a.ty = b.ty.clone();
            changed = true;
        }
        if a.constant.is_none() && b.constant.is_some() {
            a.constant = b.constant;
            changed = true;
        }
        DidMerge(changed, a.ty != b.ty || a.constant != b.constant)
    }
}

/// `?c` is a filled constant of value `value`, and `?x` already has the matched type
/// (so dropping the operation drops no broadcast).
fn neutral(
    c: &'static str,
    x: &'static str,
    value: f64,
) -> impl Fn(&mut EGraph, Id, &Subst) -> bool {
    let (c, x): (Var, Var) = (
        c.parse().expect("pattern var"),
        x.parse().expect("pattern var"),
    );
    move |eg, id, s| {
        eg[s[c]].data.constant == Some(value)
            && eg[s[x]].data.ty.is_some()
            && eg[s[x]].data.ty == eg[id].data.ty
    }
}

/// `?x` already has the matched type.
fn same_type(x: &'static str) -> impl Fn(&mut EGraph, Id, &Subst) -> bool {
    let x: Var = x.parse().expect("pattern var");
    move |eg, id, s| eg[s[x]].data.ty.is_some() && eg[s[x]].data.ty == eg[id].data.ty
}

/// Composes two transposes into one (or none, when the composition is the identity).
struct ComposeTransposes;

impl Applier<TensorLang, Types> for ComposeTransposes {
    fn apply_one(
        &self,
        eg: &mut EGraph,
        eclass: Id,
        subst: &Subst,
        _ast: Option<&PatternAst<TensorLang>>,
        _rule: Symbol,
    ) -> Vec<Id> {
        let var = |n: &str| subst[n.parse::<Var>().expect("pattern var")];
        let perm = |eg: &EGraph, id: Id| {
            eg[id].nodes.iter().find_map(|n| match n {
                TensorLang::Attr(s) => dims_attr(*s),
                _ => None,
            })
        };
        let (Some(outer), Some(inner)) = (perm(eg, var("?p2")), perm(eg, var("?p1"))) else {
            return vec![];
        };
        // y = x.permute(inner).permute(outer): y axis i is x axis inner[outer[i]].
        let composed: Vec<usize> = outer.iter().map(|&o| inner[o]).collect();
        let x = var("?x");
        let new = if composed.iter().enumerate().all(|(i, &p)| i == p) {
            x
        } else {
            let p = eg.add(TensorLang::Attr(attr("perm", &composed)));
            eg.add(TensorLang::Transpose([p, x]))
        };
        if eg.union(eclass, new) {
            vec![new]
        } else {
            vec![]
        }
    }
}

fn rules() -> Vec<egg::Rewrite<TensorLang, Types>> {
    vec![
        // x + 0 = x
        rewrite!("add-zero"; "(add ?x ?c)" => "?x" if neutral("?c", "?x", 0.0)),
        // 0 + x = x
        rewrite!("zero-add"; "(add ?c ?x)" => "?x" if neutral("?c", "?x", 0.0)),
        // x - 0 = x
        rewrite!("sub-zero"; "(sub ?x ?c)" => "?x" if neutral("?c", "?x", 0.0)),
        // x * 1 = x
        rewrite!("mul-one"; "(mul ?x ?c)" => "?x" if neutral("?c", "?x", 1.0)),
        // 1 * x = x
        rewrite!("one-mul"; "(mul ?c ?x)" => "?x" if neutral("?c", "?x", 1.0)),
        // x / 1 = x
        rewrite!("div-one"; "(div ?x ?c)" => "?x" if neutral("?c", "?x", 1.0)),
        // -(-x) = x
        rewrite!("neg-neg"; "(neg (neg ?x))" => "?x"),
        // a + (-b) = a - b
        rewrite!("add-neg"; "(add ?a (neg ?b))" => "(sub ?a ?b)"),
        // a - (-b) = a + b
        rewrite!("sub-neg"; "(sub ?a (neg ?b))" => "(add ?a ?b)"),
        // (x^p1)^p2 = x^(p1∘p2)
        rewrite!("transpose-transpose"; "(transpose ?p2 (transpose ?p1 ?x))" => { ComposeTransposes }),
        // reshape(reshape(x, s1), s2) = reshape(x, s2)
        rewrite!("reshape-reshape"; "(reshape ?s2 (reshape ?s1 ?x))" => "(reshape ?s2 ?x)"),
        // reshape(x, shape of x) = x
        rewrite!("reshape-identity"; "(reshape ?s ?x)" => "?x" if same_type("?x")),
        // transpose by the identity permutation = x
        rewrite!("transpose-identity"; "(transpose ?p ?x)" => "?x" if same_type("?x")),
    ]
}

/// Where to look an opaque op up in the table of opaque ops. `Op` holds floats, so it
/// is not `Hash`; this key is, and agrees with its `PartialEq` (equal ops, equal keys):
/// the mnemonic, a source's name, a constant's value and the result types. Ops with
/// equal keys are told apart by `==`, so a table of thousands of variables is not
/// searched from the start for each.
#[derive(PartialEq, Eq, Hash)]
struct OpKey {
    mnemonic: &'static str,
    name: Option<String>,
    value: Option<u64>,
    outputs: Vec<ValueType>,
}

impl OpKey {
    fn new(op: &Op, outputs: &[ValueType]) -> OpKey {
        let (name, value) = match op {
            Op::Input { name, .. } | Op::Param { name, .. } => (Some(name.clone()), None),
            // 0.0 == -0.0: one key for both.
            Op::Constant { value, .. } => {
                (None, Some(if *value == 0.0 { 0 } else { value.to_bits() }))
            }
            _ => (None, None),
        };
        OpKey {
            mnemonic: op.mnemonic(),
            name,
            value,
            outputs: outputs.to_vec(),
        }
    }
}

/// The graph loaded into an e-graph.
struct Loaded {
    eg: EGraph,
    /// The e-class of each value.
    class: HashMap<ValueId, Id>,
    /// The sinks with the classes they read, in order.
    sinks: Vec<(Op, Vec<Id>)>,
    /// Inputs and variables: kept whether read or not.
    keep: Vec<Id>,
}

/// Loads `g`, in topological `order`, into an e-graph (rebuilt).
fn load(g: &Graph, order: &[NodeId]) -> Loaded {
    let mut eg = EGraph::new(Types::default());
    let mut class: HashMap<ValueId, Id> = HashMap::new();
    let mut sinks: Vec<(Op, Vec<Id>)> = Vec::new();
    let mut keep: Vec<Id> = Vec::new();
    let mut table: HashMap<OpKey, Vec<usize>> = HashMap::new();
    for &id in order {
        let node = g.node(id);
        let ins: Vec<Id> = node.inputs.iter().map(|v| class[v]).collect();
        if node.op.is_sink() {
            sinks.push((node.op.clone(), ins));
            continue;
        }
        let enode = match &node.op {
            Op::Add => TensorLang::Add([ins[0], ins[1]]),
            Op::Sub => TensorLang::Sub([ins[0], ins[1]]),
            Op::Mul => TensorLang::Mul([ins[0], ins[1]]),
            Op::Div => TensorLang::Div([ins[0], ins[1]]),
            Op::Neg => TensorLang::Neg([ins[0]]),
            Op::Transpose { perm } => {
                TensorLang::Transpose([eg.add(TensorLang::Attr(attr("perm", perm))), ins[0]])
            }
            Op::Reshape { shape } => TensorLang::Reshape([
                eg.add(TensorLang::Attr(attr("shape", shape.dims()))),
                ins[0],
            ]),
            op => {
                let ops = &mut eg.analysis.ops;
                let same = table.entry(OpKey::new(op, &node.outputs)).or_default();
                let found = same
                    .iter()
                    .copied()
                    .find(|&i| ops[i].0 == *op && ops[i].1 == node.outputs);
                let idx = match found {
                    Some(i) => i,
                    None => {
                        ops.push((op.clone(), node.outputs.clone()));
                        same.push(ops.len() - 1);
                        ops.len() - 1
                    }
                };
                TensorLang::Other(Symbol::from(format!("op{idx}")), ins)
            }
        };
        let c = eg.add(enode);
        if node.outputs.len() == 1 {
            class.insert(id.into(), c);
        } else {
            for port in 0..node.outputs.len() {
                let p = eg.add(TensorLang::Attr(attr("port", &[port])));
                class.insert(id.out(port as u16), eg.add(TensorLang::Port([p, c])));
            }
        }
        if matches!(node.op, Op::Param { .. } | Op::Input { .. }) {
            keep.push(c);
        }
    }
    eg.rebuild();
    Loaded {
        eg,
        class,
        sinks,
        keep,
    }
}

/// The simplification pass, with egg's limits.
pub struct Simplify {
    /// Saturation iterations at most.
    pub iter_limit: usize,
    /// E-nodes at most.
    pub node_limit: usize,
    /// Wall time at most.
    pub time_limit: Duration,
}

impl Default for Simplify {
    fn default() -> Simplify {
        Simplify {
            iter_limit: 16,
            node_limit: 200_000,
            time_limit: Duration::from_secs(10),
        }
    }
}

impl Pass for Simplify {
    fn run(&self, g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        let before = g.node_count();
        let in_fused = simplify_fused(g)?;
        let order = g.topo_order();
        let Loaded {
            eg,
            class,
            sinks,
            keep,
        } = load(g, &order);
        let runner = egg::Runner::default()
            .with_egraph(eg)
            .with_iter_limit(self.iter_limit)
            .with_node_limit(self.node_limit)
            .with_time_limit(self.time_limit)
            .run(&rules());
        let stop = match &runner.stop_reason {
            Some(egg::StopReason::Saturated) => "saturated".to_string(),
            Some(egg::StopReason::IterationLimit(n)) => format!("iteration limit {n}"),
            Some(egg::StopReason::NodeLimit(n)) => format!("node limit {n}"),
            Some(egg::StopReason::TimeLimit(t)) => format!("time limit {t:.1} s"),
            Some(egg::StopReason::Other(s)) => s.clone(),
            None => "not run".to_string(),
        };
        let applied: usize = runner
            .iterations
            .iter()
            .map(|i| i.applied.values().sum::<usize>())
            .sum();
        let eg = runner.egraph;
        let best = Best::new(&eg);

        let mut out = Graph::new(g.name.clone());
        let mut built: HashMap<Id, ValueId> = HashMap::new();
        let roots: Vec<Id> = keep
            .iter()
            .copied()
            .chain(sinks.iter().flat_map(|(_, ins)| ins.iter().copied()))
            .collect();
        // Rebuild in the original order so the printed graph stays close to the input.
        let needed = reachable(&eg, &best, &roots);
        for &id in &order {
            if let Some(&c) = node_class(&class, g, id) {
                if needed.contains(&eg.find(c)) {
                    build(&eg, &best, c, &mut out, &mut built)?;
                }
            }
        }
        for (op, ins) in sinks {
            let vals = ins
                .iter()
                .map(|&c| build(&eg, &best, c, &mut out, &mut built))
                .collect::<Result<Vec<_>, _>>()?;
            out.add(op, vals)?;
        }
        *g = out;
        let removed = before.saturating_sub(g.node_count());
        let mut stats = PassStats::default()
            .count("removed", removed)
            .count("rewrites", applied + in_fused);
        stats.note = Some(format!("egg stopped: {stop}"));
        Ok(stats)
    }
}

/// Simplifies every `fused` node's expression ([`crate::fused_rules`]): the node is
/// replaced by one reading only the inputs the simpler expression reads, or by its one
/// input when the expression came down to it unbroadcast. Returns the nodes changed.
fn simplify_fused(g: &mut Graph) -> Result<usize, PassError> {
    let mut memo: HashMap<String, Option<distc_ir::FusedExpr>> = HashMap::new();
    let mut changed = 0;
    for id in g.node_ids() {
        let Op::Fused { expr } = g.op(id) else {
            continue;
        };
        let expr = expr.clone();
        let Some(new) = memo
            .entry(expr.to_string())
            .or_insert_with(|| crate::fused_rules::simplify(&expr))
            .clone()
        else {
            continue;
        };
        let inputs = g.node(id).inputs.clone();
        let mut read = new.input_order();
        read.sort_unstable();
        if read.is_empty() {
            // A constant: a fused node reads at least one input.
            continue;
        }
        if let [FusedStep::Input(k)] = new.steps[..] {
            if g.value_type(inputs[k]) == &g.node(id).outputs[0] {
                g.replace_all_uses(id.into(), inputs[k]);
                g.remove(id);
                changed += 1;
                continue;
            }
        }
        let renumber: HashMap<usize, usize> =
            read.iter().enumerate().map(|(n, &k)| (k, n)).collect();
        let steps = new
            .steps
            .iter()
            .map(|s| match *s {
                FusedStep::Input(k) => FusedStep::Input(renumber[&k]),
                ref s => s.clone(),
            })
            .collect();
        let op = Op::Fused {
            expr: distc_ir::FusedExpr { steps }.canonical(),
        };
        let node = g.add(op, read.iter().map(|&k| inputs[k]).collect())?;
        g.replace_all_uses(id.into(), node.into());
        g.remove(id);
        changed += 1;
    }
    Ok(changed)
}

fn node_class<'a>(class: &'a HashMap<ValueId, Id>, g: &Graph, id: NodeId) -> Option<&'a Id> {
    if g.node(id).outputs.len() == 1 {
        class.get(&id.into())
    } else {
        None
    }
}

/// The cheapest e-node of every e-class under egg's `AstSize` (one plus the costs of the
/// children, saturating), found in one sweep instead of egg's `Extractor`, which sweeps
/// every class until nothing changes: as many sweeps as the graph is deep, quadratic on
/// deep models. This is Knuth's generalisation of Dijkstra's algorithm: a node's cost
/// is more than each child's, so classes settle in increasing cost, each the first time
/// it leaves the heap. Among a class's nodes of least cost the first in the class's
/// (sorted) node list wins; the chosen node's children always settled before it, so the
/// choice never loops.
struct Best<'a> {
    eg: &'a EGraph,
    /// Per class id: index into `classes`, or `u32::MAX` for a non-canonical id.
    index: Vec<u32>,
    classes: Vec<&'a egg::EClass<TensorLang, Info>>,
    /// Per class: the chosen node's position in the class, once settled.
    chosen: Vec<Option<u32>>,
    /// Per class: the cost of the chosen node.
    #[cfg_attr(not(test), allow(dead_code))]
    cost: Vec<usize>,
    /// Heap entries made: one per e-node at most (what the tests count).
    #[cfg_attr(not(test), allow(dead_code))]
    pushes: usize,
}

impl<'a> Best<'a> {
    fn new(eg: &'a EGraph) -> Best<'a> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let classes: Vec<&egg::EClass<TensorLang, Info>> = {
            let mut c: Vec<_> = eg.classes().collect();
            c.sort_by_key(|c| c.id);
            c
        };
        let max = classes
            .iter()
            .map(|c| usize::from(c.id) + 1)
            .max()
            .unwrap_or(0);
        let mut index = vec![u32::MAX; max];
        for (i, c) in classes.iter().enumerate() {
            index[usize::from(c.id)] = i as u32;
        }
        let class_of = |id: Id| index[usize::from(eg.find(id))] as usize;
        // Every e-node as (class, position), its unsettled child occurrences, and per
        // class the e-nodes reading it (once per occurrence).
        let mut nodes: Vec<(u32, u32)> = Vec::new();
        let mut pending: Vec<u32> = Vec::new();
        let mut readers: Vec<Vec<u32>> = vec![Vec::new(); classes.len()];
        let mut heap = BinaryHeap::new();
        let mut pushes = 0;
        for (ci, class) in classes.iter().enumerate() {
            for (k, n) in class.nodes.iter().enumerate() {
                let ni = nodes.len() as u32;
                nodes.push((ci as u32, k as u32));
                pending.push(n.len() as u32);
                for &child in n.children() {
                    readers[class_of(child)].push(ni);
                }
                if n.is_leaf() {
                    heap.push(Reverse((1usize, ci as u32, k as u32)));
                    pushes += 1;
                }
            }
        }
        let mut cost: Vec<usize> = vec![usize::MAX; classes.len()];
        let mut chosen: Vec<Option<u32>> = vec![None; classes.len()];
        while let Some(Reverse((c, ci, k))) = heap.pop() {
            let ci = ci as usize;
            if chosen[ci].is_some() {
                continue;
            }
            chosen[ci] = Some(k);
            cost[ci] = c;
            for &ni in &readers[ci] {
                let ni = ni as usize;
                pending[ni] -= 1;
                if pending[ni] == 0 {
                    let (pc, pk) = nodes[ni];
                    let n = &classes[pc as usize].nodes[pk as usize];
                    let total = n
                        .children()
                        .iter()
                        .fold(1usize, |s, &ch| s.saturating_add(cost[class_of(ch)]));
                    heap.push(Reverse((total, pc, pk)));
                    pushes += 1;
                }
            }
        }
        Best {
            eg,
            index,
            classes,
            chosen,
            cost,
            pushes,
        }
    }

    /// The chosen e-node of class `c`; None for a class with no finite term, which a
    /// graph loaded from a DAG does not have.
    fn node(&self, c: Id) -> Option<&'a TensorLang> {
        let i = *self.index.get(usize::from(self.eg.find(c)))? as usize;
        let k = (*self.chosen.get(i)?)? as usize;
        self.classes[i].nodes.get(k)
    }
}

fn reachable(eg: &EGraph, best: &Best, roots: &[Id]) -> HashSet<Id> {
    let mut seen = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|&r| eg.find(r)).collect();
    while let Some(c) = stack.pop() {
        if seen.insert(c) {
            if let Some(n) = best.node(c) {
                stack.extend(n.children().iter().map(|&k| eg.find(k)));
            }
        }
    }
    seen
}

fn build(
    eg: &EGraph,
    best: &Best,
    c: Id,
    out: &mut Graph,
    built: &mut HashMap<Id, ValueId>,
) -> Result<ValueId, PassError> {
    let c = eg.find(c);
    if let Some(v) = built.get(&c) {
        return Ok(*v);
    }
    let node = best
        .node(c)
        .ok_or_else(|| PassError::Precondition("simplify: an e-class without a term".into()))?
        .clone();
    let v = match &node {
        TensorLang::Port([p, x]) => {
            let base = build(eg, best, *x, out, built)?;
            let port = eg[*p]
                .nodes
                .iter()
                .find_map(|n| match n {
                    TensorLang::Attr(s) => dims_attr(*s).and_then(|v| v.first().copied()),
                    _ => None,
                })
                .ok_or_else(|| PassError::Precondition("simplify: malformed port".into()))?;
            base.node.out(port as u16)
        }
        TensorLang::Attr(_) => {
            return Err(PassError::Precondition(
                "simplify: attribute used as a value".into(),
            ))
        }
        n => {
            let op = ir_op(eg, n)
                .ok_or_else(|| PassError::Precondition("simplify: unknown e-node".into()))?;
            let ins = operands(n)
                .iter()
                .map(|&k| build(eg, best, k, out, built))
                .collect::<Result<Vec<_>, _>>()?;
            out.add(op, ins)?.into()
        }
    };
    built.insert(c, v);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use distc_ir::{DType, Init, TensorType};

    /// `layers` of `relu(h * w + b) * 1 + 0` and a double transpose, with a loss: deep,
    /// with rules to apply at every layer.
    fn deep(layers: usize) -> Graph {
        let mut g = Graph::new("deep");
        let t = |d: Vec<usize>| TensorType::new(DType::F32, d);
        let x = g
            .add(
                Op::Input {
                    name: "x".into(),
                    ty: t(vec![4, 4]),
                },
                vec![],
            )
            .expect("well typed");
        let one = g
            .add(
                Op::Constant {
                    value: 1.0,
                    ty: t(vec![]),
                },
                vec![],
            )
            .expect("well typed");
        let zero = g
            .add(
                Op::Constant {
                    value: 0.0,
                    ty: t(vec![]),
                },
                vec![],
            )
            .expect("well typed");
        let mut h = ValueId::from(x);
        for i in 0..layers {
            let w = g
                .add(
                    Op::Param {
                        name: format!("w{i}"),
                        ty: t(vec![4, 4]),
                        init: Init::Glorot,
                        frozen: false,
                    },
                    vec![],
                )
                .expect("well typed");
            let m = g
                .add(
                    Op::MatMul {
                        transpose_a: false,
                        transpose_b: false,
                    },
                    vec![h, w.into()],
                )
                .expect("well typed");
            let r = g.add(Op::Relu, vec![m.into()]).expect("well typed");
            let a = g
                .add(Op::Mul, vec![r.into(), one.into()])
                .expect("well typed");
            let b = g
                .add(Op::Add, vec![a.into(), zero.into()])
                .expect("well typed");
            let p = g
                .add(Op::Transpose { perm: vec![1, 0] }, vec![b.into()])
                .expect("well typed");
            let q = g
                .add(Op::Transpose { perm: vec![1, 0] }, vec![p.into()])
                .expect("well typed");
            h = q.into();
        }
        let s = g
            .add(
                Op::Mean {
                    axes: vec![0, 1],
                    keep_dims: false,
                },
                vec![h],
            )
            .expect("well typed");
        g.add(Op::Loss, vec![s.into()]).expect("well typed");
        g
    }

    fn saturated(g: &Graph) -> EGraph {
        let loaded = load(g, &g.topo_order());
        egg::Runner::default()
            .with_egraph(loaded.eg)
            .with_iter_limit(16)
            .run(&rules())
            .egraph
    }

    #[test]
    fn extraction_costs_are_egg_extractor_costs() {
        let eg = saturated(&deep(30));
        let ours = Best::new(&eg);
        let egg_ex = egg::Extractor::new(&eg, egg::AstSize);
        for class in eg.classes() {
            let i = ours.index[usize::from(class.id)] as usize;
            assert_eq!(
                ours.cost[i],
                egg_ex.find_best_cost(class.id),
                "class {}",
                class.id
            );
            let node = ours.node(class.id).expect("a term");
            let cost = node
                .children()
                .iter()
                .fold(1usize, |s, &c| s.saturating_add(egg_ex.find_best_cost(c)));
            assert_eq!(cost, ours.cost[i], "chosen node of class {}", class.id);
        }
    }

    #[test]
    fn extraction_visits_each_enode_once() {
        // egg's extractor sweeps every class once per level of depth; this one makes
        // one heap entry per e-node at most, however deep the graph.
        let eg = saturated(&deep(2000));
        let best = Best::new(&eg);
        assert!(
            best.pushes <= eg.total_number_of_nodes(),
            "{} pushes",
            best.pushes
        );
    }

    #[test]
    fn opaque_ops_are_shared_by_value() {
        let g = deep(50);
        let loaded = load(&g, &g.topo_order());
        // One entry per distinct opaque op: input, two constants, 50 variables, matmul,
        // relu, mean.
        assert_eq!(loaded.eg.analysis.ops.len(), 56);
    }
}
