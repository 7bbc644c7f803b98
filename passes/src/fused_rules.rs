//! Algebraic identities inside a `fused` node's expression, with egg: the element-wise
//! functions of the DSL (`pow`, `sqrt`, `rsqrt`, ...) live there, out of the graph-level
//! language of [`crate::simplify`], which sees a fused node as one opaque op. Each rule
//! holds for every IEEE value, NaN and infinities included (so no `x - x = 0`, no
//! `sqrt(x) * sqrt(x) = x`); the cheapest equivalent expression is extracted, a `pow`
//! counting as a transcendental call. Used by the simplify pass on every fused node.
//! Before/after:
//! ```text
//! fused{expr="mul(pow(in0, 2.0), pow(in1, 1.0))"}   =>  fused{expr="mul(mul(in0, in0), in1)"}
//! fused{expr="div(1.0, sqrt(add(in0, 1e-5)))"}       =>  fused{expr="rsqrt(add(in0, 1e-5))"}
//! ```

use distc_ir::{FusedExpr, FusedStep};
use egg::{define_language, rewrite, Id, Language, RecExpr, Subst, Symbol, Var};

define_language! {
    /// A fused expression: leaves are inputs (`in3`) or constants (their f64 text);
    /// every function is an `Op` named as the IR's text form names it.
    enum FusedLang {
        Leaf(Symbol),
        Op(Symbol, Vec<Id>),
    }
}

type EGraph = egg::EGraph<FusedLang, ()>;

/// `?c` is the constant `value`.
fn is(c: &'static str, value: f64) -> impl Fn(&mut EGraph, Id, &Subst) -> bool {
    let c: Var = c.parse().expect("pattern var");
    move |eg, _, s| {
        eg[s[c]].nodes.iter().any(|n| match n {
            FusedLang::Leaf(sym) => sym.as_str().parse::<f64>() == Ok(value),
            _ => false,
        })
    }
}

fn rules() -> Vec<egg::Rewrite<FusedLang, ()>> {
    vec![
        rewrite!("neg-neg"; "(neg (neg ?x))" => "?x"),
        rewrite!("add-neg"; "(add ?a (neg ?b))" => "(sub ?a ?b)"),
        rewrite!("sub-neg"; "(sub ?a (neg ?b))" => "(add ?a ?b)"),
        rewrite!("mul-one"; "(mul ?x ?c)" => "?x" if is("?c", 1.0)),
        rewrite!("one-mul"; "(mul ?c ?x)" => "?x" if is("?c", 1.0)),
        rewrite!("div-one"; "(div ?x ?c)" => "?x" if is("?c", 1.0)),
        // pow(x, 0) is 1 for every x, NaN included (IEEE 754 and C's pow).
        rewrite!("pow-zero"; "(pow ?x ?c)" => "1.0" if is("?c", 0.0)),
        rewrite!("pow-one"; "(pow ?x ?c)" => "?x" if is("?c", 1.0)),
        // One rounding either way: x * x and 1 / x are the correctly rounded results.
        rewrite!("pow-two"; "(pow ?x ?c)" => "(mul ?x ?x)" if is("?c", 2.0)),
        rewrite!("pow-minus-one"; "(pow ?x ?c)" => "(div 1.0 ?x)" if is("?c", -1.0)),
        rewrite!("recip-sqrt"; "(div ?c (sqrt ?x))" => "(rsqrt ?x)" if is("?c", 1.0)),
    ]
}

/// Transcendental calls cost more than arithmetic; a `pow` most.
struct Cost;

impl egg::CostFunction<FusedLang> for Cost {
    type Cost = usize;

    fn cost<C: FnMut(Id) -> usize>(&mut self, enode: &FusedLang, mut costs: C) -> usize {
        let own = match enode {
            FusedLang::Leaf(_) => 0,
            FusedLang::Op(name, _) => match name.as_str() {
                "pow" => 16,
                "add" | "sub" | "mul" | "neg" | "relu" | "step" | "keep" => 1,
                "div" => 2,
                _ => 4,
            },
        };
        enode.fold(own, |sum, id| sum + costs(id))
    }
}

/// `e` with every step whose operands are all constants computed (in f64, as the
/// kernels compute a constant's f32 from its f64): a gradient's `pow(x, sub(2.0, 1.0))`.
fn fold(e: &FusedExpr) -> FusedExpr {
    let mut steps: Vec<FusedStep> = Vec::with_capacity(e.steps.len());
    for s in &e.steps {
        let constant = |i: usize| match steps[i] {
            FusedStep::Const(c) => Some(c),
            _ => None,
        };
        let folded = match *s {
            FusedStep::Unary(f, a) => constant(a).map(|x| f.eval(x)),
            FusedStep::Binary(f, a, b) => constant(a).zip(constant(b)).map(|(x, y)| f.eval(x, y)),
            _ => None,
        };
        steps.push(match folded {
            Some(v) if v.is_finite() => FusedStep::Const(v),
            _ => s.clone(),
        });
    }
    FusedExpr { steps }
}

fn to_rec(e: &FusedExpr) -> RecExpr<FusedLang> {
    let mut rec = RecExpr::default();
    let mut ids = Vec::with_capacity(e.steps.len());
    for s in &e.steps {
        let node = match *s {
            FusedStep::Input(k) => FusedLang::Leaf(Symbol::from(format!("in{k}"))),
            FusedStep::Const(c) => FusedLang::Leaf(Symbol::from(format!("{c:?}"))),
            FusedStep::Unary(f, a) => FusedLang::Op(Symbol::from(f.name()), vec![ids[a]]),
            FusedStep::Binary(f, a, b) => {
                FusedLang::Op(Symbol::from(f.name()), vec![ids[a], ids[b]])
            }
        };
        ids.push(rec.add(node));
    }
    rec
}

/// The text form of node `id` of `rec`, which the fused-expression parser reads.
fn text(rec: &RecExpr<FusedLang>, id: Id) -> String {
    match &rec[id] {
        FusedLang::Leaf(s) => s.as_str().to_string(),
        FusedLang::Op(name, args) => {
            let args: Vec<String> = args.iter().map(|&a| text(rec, a)).collect();
            format!("{name}({})", args.join(", "))
        }
    }
}

/// The cheapest expression equal to `e`, when it is cheaper; `None` when no rule
/// makes it so.
pub fn simplify(e: &FusedExpr) -> Option<FusedExpr> {
    let before = egg::CostFunction::cost_rec(&mut Cost, &to_rec(e));
    let rec = to_rec(&fold(e).canonical());
    let runner = egg::Runner::default()
        .with_iter_limit(8)
        .with_node_limit(2_000)
        .with_expr(&rec)
        .run(&rules());
    let (cost, best) = egg::Extractor::new(&runner.egraph, Cost).find_best(runner.roots[0]);
    if cost >= before {
        return None;
    }
    let root = Id::from(best.as_ref().len() - 1);
    text(&best, root).parse::<FusedExpr>().ok()
}

#[cfg(test)]
mod tests {
    use super::simplify;
    use distc_ir::FusedExpr;

    fn simplified(e: &str) -> Option<String> {
        simplify(&e.parse::<FusedExpr>().expect("parses")).map(|e| e.to_string())
    }

    #[test]
    fn powers_and_reciprocal_roots_become_arithmetic() {
        assert_eq!(
            simplified("mul(pow(in0, 2.0), pow(in1, 1.0))").as_deref(),
            Some("mul(mul(in0, in0), in1)")
        );
        assert_eq!(
            simplified("div(1.0, sqrt(add(in0, 1e-5)))").as_deref(),
            Some("rsqrt(add(in0, 1e-5))")
        );
        assert_eq!(
            simplified("add(pow(in0, 0.0), in1)").as_deref(),
            Some("add(1.0, in1)")
        );
        assert_eq!(
            simplified("pow(in0, -1.0)").as_deref(),
            Some("div(1.0, in0)")
        );
        assert_eq!(
            simplified("neg(neg(gelu(in0)))").as_deref(),
            Some("gelu(in0)")
        );
    }

    #[test]
    fn what_is_not_exact_for_every_value_is_left() {
        // sqrt(x)^2 is NaN for x < 0, x - x is NaN for infinite x, pow(x, 0.5) differs
        // from sqrt(x) at -0 and -inf.
        for e in [
            "mul(sqrt(in0), sqrt(in0))",
            "sub(in0, in0)",
            "pow(in0, 0.5)",
            "gelu(in0)",
        ] {
            assert_eq!(simplified(e), None, "{e}");
        }
    }
}
