//! Pointwise kernels: unary maths, broadcasting binary maths, the activation
//! gradients, dropout, constants and fused element-wise expressions.
//!
//! Kernels over operands of one shape take the element count as an argument, so one
//! body serves every size. A broadcasting operand gets its index map baked in (see
//! `index`), one kernel per shape combination. No pointer is `__restrict__`: the
//! executor may give an element-wise output its input's buffer, and every kernel here
//! reads element `i` before writing element `i`.

use super::index::broadcast_map;
use super::{flit, want_f32, want_float, KArg, Launch, NodeCx, INDEX};
use distc_ir::fused::{GELU_TANH_C, GELU_TANH_K};
use distc_ir::{BinaryFn, DType, FusedExpr, FusedStep, TensorType, UnaryFn};

/// A unary op of the IR.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Un {
    Neg,
    Relu,
    Sigmoid,
    Tanh,
    Exp,
    Log,
}

/// A broadcasting binary op of the IR.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Bin {
    Add,
    Sub,
    Mul,
    Div,
}

/// An activation gradient `(dy, saved) -> dx`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Grad {
    Relu,
    Sigmoid,
    Tanh,
}

/// The C expression of a unary function of `v` (a variable: some read it twice).
/// Written as the CPU kernels compute it: relu of NaN is 0, sigmoid is
/// `1 / (1 + exp(-v))`.
fn unary_expr(f: UnaryFn, v: &str) -> String {
    match f {
        UnaryFn::Neg => format!("(-{v})"),
        UnaryFn::Relu => format!("({v} > 0.0f ? {v} : 0.0f)"),
        UnaryFn::Sigmoid => format!("(1.0f / (1.0f + expf(-{v})))"),
        UnaryFn::Tanh => format!("tanhf({v})"),
        UnaryFn::Exp => format!("expf({v})"),
        UnaryFn::Log => format!("logf({v})"),
        UnaryFn::Step => format!("({v} > 0.0f ? 1.0f : 0.0f)"),
        UnaryFn::Sqrt => format!("sqrtf({v})"),
        UnaryFn::Rsqrt => format!("(1.0f / sqrtf({v}))"),
        UnaryFn::Gelu => format!("({v} * 0.5f * (1.0f + erff({v} * 0.70710678118654752f)))"),
        UnaryFn::GeluTanh => format!(
            "(0.5f * {v} * (1.0f + tanhf({c}f * ({v} + {k}f * {v} * {v} * {v}))))",
            c = GELU_TANH_C,
            k = GELU_TANH_K
        ),
        UnaryFn::Silu => format!("({v} / (1.0f + expf(-{v})))"),
        UnaryFn::GeluDerivative => format!(
            "(0.5f * (1.0f + erff({v} * 0.70710678118654752f)) + {v} * expf(-0.5f * {v} * {v}) * 0.3989422804014327f)"
        ),
        UnaryFn::GeluTanhDerivative => format!(
            "(0.5f * (1.0f + tanhf({c}f * ({v} + {k}f * {v} * {v} * {v}))) + 0.5f * {v} * (1.0f - tanhf({c}f * ({v} + {k}f * {v} * {v} * {v})) * tanhf({c}f * ({v} + {k}f * {v} * {v} * {v}))) * {c}f * (1.0f + {k3}f * {v} * {v}))",
            c = GELU_TANH_C,
            k = GELU_TANH_K,
            k3 = 3.0 * GELU_TANH_K
        ),
        UnaryFn::SiluDerivative => format!(
            "((1.0f / (1.0f + expf(-{v}))) * (1.0f + {v} * (1.0f - 1.0f / (1.0f + expf(-{v})))))"
        ),
    }
}

fn binary_expr(f: BinaryFn, a: &str, b: &str) -> String {
    let op = match f {
        BinaryFn::Add => "+",
        BinaryFn::Sub => "-",
        BinaryFn::Mul => "*",
        BinaryFn::Div => "/",
        BinaryFn::Pow => return format!("powf({a}, {b})"),
        BinaryFn::Keep => return format!("({a} != 0.0f ? {b} : 0.0f)"),
        BinaryFn::Less => "<",
        BinaryFn::LessEqual => "<=",
        BinaryFn::Greater => ">",
        BinaryFn::GreaterEqual => ">=",
        BinaryFn::Equal => "==",
        BinaryFn::NotEqual => "!=",
    };
    if f.is_comparison() {
        return format!("(({a} {op} {b}) ? 1.0f : 0.0f)");
    }
    format!("({a} {op} {b})")
}

impl Un {
    fn func(self) -> UnaryFn {
        match self {
            Un::Neg => UnaryFn::Neg,
            Un::Relu => UnaryFn::Relu,
            Un::Sigmoid => UnaryFn::Sigmoid,
            Un::Tanh => UnaryFn::Tanh,
            Un::Exp => UnaryFn::Exp,
            Un::Log => UnaryFn::Log,
        }
    }
}

impl Bin {
    fn func(self) -> BinaryFn {
        match self {
            Bin::Add => BinaryFn::Add,
            Bin::Sub => BinaryFn::Sub,
            Bin::Mul => BinaryFn::Mul,
            Bin::Div => BinaryFn::Div,
        }
    }
}

/// `y = f(x)`, one kernel per function for every size.
pub(crate) fn unary(cx: &mut NodeCx<'_>, f: Un) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    let (ex, ey) = (want_float(&x, "input 0")?, want_float(&y, "the output")?);
    let n = x.shape.numel();
    let f = f.func();
    let text = format!(
        "extern \"C\" __global__ void KNAME(const {}* x, {}* y, u64 n) {{\n{INDEX}    float v = {};\n    {}\n}}\n",
        ex.c(),
        ey.c(),
        ex.load("x[i]"),
        ey.store("y", "i", &unary_expr(f, "v")),
    );
    let name = cx.kernel(f.name(), text);
    cx.launch_1d(
        &name,
        n,
        vec![KArg::Input(0), KArg::Output(0), KArg::U64(n as u64)],
    )
}

/// `y = f(a, b)` with numpy broadcasting: the plain kernel when both operands have the
/// output's shape, else one with each operand's broadcast map baked in.
pub(crate) fn binary(cx: &mut NodeCx<'_>, f: Bin) -> Result<(), String> {
    let (a, b, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    let (ea, eb, ey) = (
        want_float(&a, "input 0")?,
        want_float(&b, "input 1")?,
        want_float(&y, "the output")?,
    );
    let n = y.shape.numel();
    let f = f.func();
    let ma = broadcast_map(a.dims(), y.dims())
        .ok_or_else(|| format!("{a} does not broadcast to the output {y}"))?;
    let mb = broadcast_map(b.dims(), y.dims())
        .ok_or_else(|| format!("{b} does not broadcast to the output {y}"))?;
    let same = ma.is_identity() && mb.is_identity() && a.dims() == y.dims() && b.dims() == y.dims();
    let params = format!(
        "const {}* a, const {}* b, {}* y, u64 n",
        ea.c(),
        eb.c(),
        ey.c()
    );
    let text = if same {
        format!(
            "extern \"C\" __global__ void KNAME({params}) {{\n{INDEX}    {}\n}}\n",
            ey.store(
                "y",
                "i",
                &binary_expr(f, &ea.load("a[i]"), &eb.load("b[i]"))
            )
        )
    } else {
        format!(
            "// {a} {op} {b} -> {y}\nextern \"C\" __global__ void KNAME({params}) {{\n{INDEX}    {}\n    {}\n    {}\n}}\n",
            ma.emit("ia", "i"),
            mb.emit("ib", "i"),
            ey.store("y", "i", &binary_expr(f, &ea.load("a[ia]"), &eb.load("b[ib]"))),
            op = f.name(),
        )
    };
    let base = if same {
        f.name().to_string()
    } else {
        format!("{}_bcast", f.name())
    };
    let name = cx.kernel(&base, text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Output(0),
            KArg::U64(n as u64),
        ],
    )
}

/// `(dy, saved) -> dx` of relu, sigmoid and tanh (operands of one shape).
pub(crate) fn grad(cx: &mut NodeCx<'_>, g: Grad) -> Result<(), String> {
    let (d, s, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    let (ed, es, ey) = (
        want_float(&d, "dy")?,
        want_float(&s, "the saved value")?,
        want_float(&y, "the output")?,
    );
    if d.dims() != s.dims() {
        return Err(format!("dy {d} and the saved value {s} differ"));
    }
    let n = d.shape.numel();
    // Each operand read through its type (a plain read for f32, so f32 kernels are
    // what they were).
    let (dv, sv) = (ed.load("d[i]"), es.load("s[i]"));
    let (base, expr) = match g {
        Grad::Relu => ("relu_grad", format!("{sv} > 0.0f ? {dv} : 0.0f")),
        Grad::Sigmoid => ("sigmoid_grad", format!("{dv} * {sv} * (1.0f - {sv})")),
        Grad::Tanh => ("tanh_grad", format!("{dv} * (1.0f - {sv} * {sv})")),
    };
    let body = ey.store("y", "i", &expr);
    let text = format!(
        "extern \"C\" __global__ void KNAME(const {}* d, const {}* s, {}* y, u64 n) {{\n{INDEX}    {body}\n}}\n",
        ed.c(),
        es.c(),
        ey.c()
    );
    let name = cx.kernel(base, text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Output(0),
            KArg::U64(n as u64),
        ],
    )
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Inverted dropout (and its gradient, which drops the same elements): the CPU
/// backend's mask exactly, a splitmix64 hash of `(seed, step, element index)` with
/// the step read from device memory, so a replayed CUDA graph draws the step's mask.
/// With `per_sample` the index is the element's position in the global batch
/// (`rank * n + i`). The identity when the run is not training.
pub(crate) fn dropout(
    cx: &mut NodeCx<'_>,
    rate: f64,
    seed: u64,
    per_sample: bool,
) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    want_f32(&x, "input 0")?;
    if !(0.0..1.0).contains(&rate) {
        return Err(format!("rate {rate} is not in [0, 1)"));
    }
    let n = x.shape.numel();
    // `rate * 2^64`, saturating, as the CPU computes it: dropped when the hash is below.
    let threshold = (rate * 18_446_744_073_709_551_616.0) as u64;
    let scale = flit(1.0 / (1.0 - rate));
    let index = if per_sample { "(u64)rank * n + i" } else { "i" };
    let text = format!(
        "// dropout rate {rate}, seed {seed}{ps}\nextern \"C\" __global__ void KNAME(const float* x, float* y, u64 n, const u64* step, u32 rank, u32 training) {{\n{INDEX}    if (!training) {{ y[i] = x[i]; return; }}\n    u64 base = mix64(mix64({seed}ull + 0x{GOLDEN:X}ull) ^ (*step * 0x{GOLDEN:X}ull + 1ull));\n    u64 h = mix64(base + ({index} + 1ull) * 0x{GOLDEN:X}ull);\n    y[i] = h >= {threshold}ull ? x[i] * {scale} : 0.0f;\n}}\n",
        ps = if per_sample { ", per sample" } else { "" },
    );
    let name = cx.kernel("dropout", text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U64(n as u64),
            KArg::Step,
            KArg::Rank,
            KArg::Training,
        ],
    )
}

/// A constant tensor: a memset for zeros, else a fill with the value's 32-bit pattern
/// (an f32, or an i32).
pub(crate) fn constant(cx: &mut NodeCx<'_>, value: f64, ty: &TensorType) -> Result<(), String> {
    let bits: u32 = match ty.dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::I32 => (value as i32) as u32,
        DType::F64 | DType::BF16 | DType::F16 => {
            return Err(format!("a constant of {ty}: the GPU runs f32 and i32"))
        }
    };
    let n = ty.shape.numel();
    if bits == 0 {
        cx.out.launches.push(Launch::Memset {
            buf: KArg::Output(0),
            bytes: (4 * n) as u64,
        });
        return Ok(());
    }
    let text = format!(
        "extern \"C\" __global__ void KNAME(u32* y, u32 bits, u64 n) {{\n{INDEX}    y[i] = bits;\n}}\n"
    );
    let name = cx.kernel("fill32", text);
    cx.launch_1d(
        &name,
        n,
        vec![KArg::Output(0), KArg::U32(bits), KArg::U64(n as u64)],
    )
}

/// The kernel of a fused element-wise expression (`KNAME` for its name): arguments
/// are the inputs' pointers in order, then the output's, then the element count (a
/// u64). Each input is read through its broadcast map to the output's shape; each
/// step is one float temporary, the last one stored.
pub fn fused_kernel(
    expr: &FusedExpr,
    inputs: &[TensorType],
    output: &TensorType,
) -> Result<String, String> {
    let ey = want_float(output, "the output")?;
    if expr.steps.is_empty() {
        return Err("the fused expression has no steps".into());
    }
    let mut params = Vec::new();
    let mut elems = Vec::new();
    let mut maps = String::new();
    for (k, t) in inputs.iter().enumerate() {
        let e = want_float(t, &format!("input {k}"))?;
        params.push(format!("const {}* in{k}", e.c()));
        elems.push(e);
        let m = broadcast_map(t.dims(), output.dims())
            .ok_or_else(|| format!("input {k} {t} does not broadcast to the output {output}"))?;
        if t.dims() == output.dims() {
            maps.push_str(&format!("    u64 o{k} = i;\n"));
        } else {
            maps.push_str(&format!("    {}\n", m.emit(&format!("o{k}"), "i")));
        }
    }
    let mut body = String::new();
    for (s, step) in expr.steps.iter().enumerate() {
        let arg = |j: usize| {
            if j < s {
                Ok(format!("s{j}"))
            } else {
                Err(format!("step {s} reads step {j}, which is not before it"))
            }
        };
        let e = match step {
            FusedStep::Input(k) => {
                if *k >= inputs.len() {
                    return Err(format!(
                        "step {s} reads input {k} of {} inputs",
                        inputs.len()
                    ));
                }
                elems[*k].load(&format!("in{k}[o{k}]"))
            }
            FusedStep::Const(c) => flit(*c),
            FusedStep::Unary(f, a) => unary_expr(*f, &arg(*a)?),
            FusedStep::Binary(f, a, b) => binary_expr(*f, &arg(*a)?, &arg(*b)?),
        };
        body.push_str(&format!("    float s{s} = {e};\n"));
    }
    let last = expr.steps.len() - 1;
    params.push(format!("{}* y", ey.c()));
    params.push("u64 n".into());
    let shapes: Vec<String> = inputs.iter().map(|t| t.to_string()).collect();
    Ok(format!(
        "// fused ({}) -> {output}\nextern \"C\" __global__ void KNAME({}) {{\n{INDEX}{maps}{body}    {}\n}}\n",
        shapes.join(", "),
        params.join(", "),
        ey.store("y", "i", &format!("s{last}"))
    ))
}

/// A fused node: its expression's kernel over the output's elements.
pub(crate) fn fused(cx: &mut NodeCx<'_>, expr: &FusedExpr) -> Result<(), String> {
    let inputs: Vec<TensorType> = (0..cx.ins.len())
        .map(|i| cx.tin(i).cloned())
        .collect::<Result<_, _>>()?;
    let y = cx.tout(0)?.clone();
    let text = fused_kernel(expr, &inputs, &y)?;
    let name = cx.kernel("fused", text);
    let n = y.shape.numel();
    let mut args: Vec<KArg> = (0..inputs.len()).map(KArg::Input).collect();
    args.push(KArg::Output(0));
    args.push(KArg::U64(n as u64));
    cx.launch_1d(&name, n, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_kernels_read_broadcast_inputs_and_refuse_bad_steps() {
        let expr = FusedExpr {
            steps: vec![
                FusedStep::Input(0),
                FusedStep::Input(1),
                FusedStep::Binary(BinaryFn::Add, 0, 1),
                FusedStep::Unary(UnaryFn::Relu, 2),
            ],
        };
        let x = TensorType::f32(vec![4, 3]);
        let b = TensorType::f32(vec![3]);
        let text = fused_kernel(&expr, &[x.clone(), b.clone()], &x).expect("a kernel");
        assert!(text.contains("u64 o0 = i;"), "{text}");
        assert!(text.contains("o1 += (r_ % 3ull) * 1ull"), "{text}");
        assert!(
            text.contains("float s3 = (s2 > 0.0f ? s2 : 0.0f);"),
            "{text}"
        );
        let bad = FusedExpr {
            steps: vec![FusedStep::Unary(UnaryFn::Neg, 0)],
        };
        assert!(fused_kernel(&bad, std::slice::from_ref(&x), &x).is_err());
        let bad = FusedExpr {
            steps: vec![FusedStep::Input(2)],
        };
        assert!(fused_kernel(&bad, std::slice::from_ref(&x), &x).is_err());
        assert!(fused_kernel(&expr, &[x.clone(), TensorType::f32(vec![2])], &x).is_err());
    }
}
