//! The emulator's cuBLAS: `cublasSgemmStridedBatched` as cuBLAS defines it, on host
//! slices, and `cublasGemmStridedBatchedEx` for bf16 and f16 matrices with f32
//! accumulation ([`gemm_ex_16`]). Column-major: element `(i, j)` of a matrix with leading dimension `ld` is
//! at `i + j * ld`; `op(A)` is `m x k`, `op(B)` is `k x n`, `C` is `m x n`. The
//! arguments cuBLAS refuses (`CUBLAS_STATUS_INVALID_VALUE`) are refused here, and a
//! product that would read or write past a buffer is an error naming the buffer,
//! where a GPU would read garbage or fault: a row-major/column-major swap shows up
//! as one or the other.

/// One strided-batched product's parameters, in cuBLAS's terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgemmCall {
    /// The element type of `A`, `B` and `C` (f32, or bf16/f16 for GemmEx).
    pub dtype: distc_ir::DType,
    /// `op(A) = Aᵀ`.
    pub transa: bool,
    /// `op(B) = Bᵀ`.
    pub transb: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Leading dimension of `A`.
    pub lda: usize,
    /// Elements between consecutive `A`s.
    pub stride_a: usize,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Elements between consecutive `B`s.
    pub stride_b: usize,
    /// Scale of `C`'s old contents (0: `C` is only written, never read).
    pub beta: f32,
    /// Leading dimension of `C`.
    pub ldc: usize,
    /// Elements between consecutive `C`s.
    pub stride_c: usize,
    /// Products in the batch.
    pub batch: usize,
}

/// The last element a strided batch of `rows x cols` column-major matrices touches,
/// plus one.
fn extent(rows: usize, cols: usize, ld: usize, stride: usize, batch: usize) -> usize {
    if rows == 0 || cols == 0 || batch == 0 {
        return 0;
    }
    (batch - 1) * stride + (cols - 1) * ld + rows
}

/// Runs `call` on `a`, `b` and `c` (each the whole buffer cuBLAS was given).
pub fn sgemm_strided_batched(
    call: &SgemmCall,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), String> {
    let g = call;
    // op(A) is m x k: A is stored m x k, or k x m when transposed.
    let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    for (name, ld, rows) in [
        ("lda", g.lda, a_rows),
        ("ldb", g.ldb, b_rows),
        ("ldc", g.ldc, g.m),
    ] {
        if ld < rows.max(1) {
            return Err(format!(
                "cuBLAS refuses {name} = {ld}: it must be at least {} (CUBLAS_STATUS_INVALID_VALUE)",
                rows.max(1)
            ));
        }
    }
    for (name, need, have) in [
        (
            "A",
            extent(a_rows, a_cols, g.lda, g.stride_a, g.batch),
            a.len(),
        ),
        (
            "B",
            extent(b_rows, b_cols, g.ldb, g.stride_b, g.batch),
            b.len(),
        ),
        ("C", extent(g.m, g.n, g.ldc, g.stride_c, g.batch), c.len()),
    ] {
        if need > have {
            return Err(format!(
                "the product reaches element {} of {name}, which holds {have}: a leading \
                 dimension, stride or transpose does not fit the buffer",
                need - 1
            ));
        }
    }
    use ndarray::{linalg::general_mat_mul, ArrayView2, ArrayViewMut2, ShapeBuilder};
    // Column-major as strided views: op(A)'s element (i, p) is `i + p lda` or, under a
    // transpose, `p + i lda`. The product is matrixmultiply's (as the CPU backend's),
    // each element of C summed on one thread, so a step is deterministic; beta = 0
    // never reads C (it may hold NaN), as cuBLAS documents.
    let strides = |trans: bool, ld: usize| if trans { (ld, 1) } else { (1, ld) };
    fn view(
        m: &[f32],
        at: usize,
        rows: usize,
        cols: usize,
        s: (usize, usize),
    ) -> Result<ArrayView2<'_, f32>, String> {
        ArrayView2::from_shape((rows, cols).strides(s), m.get(at..).unwrap_or(&[]))
            .map_err(|e| format!("a {rows} x {cols} view at element {at}: {e}"))
    }
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    for bi in 0..g.batch {
        let (ao, bo, co) = (bi * g.stride_a, bi * g.stride_b, bi * g.stride_c);
        let op_a = view(a, ao, g.m, g.k, strides(g.transa, g.lda))?;
        let op_b = view(b, bo, g.k, g.n, strides(g.transb, g.ldb))?;
        let mut out = ArrayViewMut2::from_shape((g.m, g.n).strides((1, g.ldc)), &mut c[co..])
            .map_err(|e| format!("C's {} x {} view at element {co}: {e}", g.m, g.n))?;
        general_mat_mul(g.alpha, &op_a, &op_b, g.beta, &mut out);
    }
    Ok(())
}

/// `cublasGemmStridedBatchedEx` on 16-bit matrices (each element the bits of a bf16 or
/// an f16, as `call.dtype` says) with `CUBLAS_COMPUTE_32F`: the products are summed in
/// f32 and each result is rounded to 16 bits once, as on the tensor cores (whose
/// summation order may differ in the last f32 bits).
pub fn gemm_ex_16(call: &SgemmCall, a: &[u16], b: &[u16], c: &mut [u16]) -> Result<(), String> {
    use distc_ir::DType;
    type Widen = fn(u16) -> f32;
    type Narrow = fn(f32) -> u16;
    let (widen, narrow): (Widen, Narrow) = match call.dtype {
        DType::BF16 => (
            |x| half::bf16::from_bits(x).to_f32(),
            |v| half::bf16::from_f32(v).to_bits(),
        ),
        DType::F16 => (
            |x| half::f16::from_bits(x).to_f32(),
            |v| half::f16::from_f32(v).to_bits(),
        ),
        other => {
            return Err(format!(
                "GemmEx here takes bf16 or f16 matrices, not {}",
                other.name()
            ))
        }
    };
    let wa: Vec<f32> = a.iter().map(|&x| widen(x)).collect();
    let wb: Vec<f32> = b.iter().map(|&x| widen(x)).collect();
    // beta = 0 never reads C: its old bits are widened but not used.
    let mut wc: Vec<f32> = c.iter().map(|&x| widen(x)).collect();
    sgemm_strided_batched(call, &wa, &wb, &mut wc)?;
    // Only the elements the product wrote change: the rest keep their bits.
    let g = call;
    for bi in 0..g.batch {
        for j in 0..g.n {
            for i in 0..g.m {
                let at = bi * g.stride_c + i + j * g.ldc;
                c[at] = narrow(wc[at]);
            }
        }
    }
    Ok(())
}

impl SgemmCall {
    /// The call a generated [`crate::cuda::codegen::Gemm`] makes.
    pub fn of(g: &crate::cuda::codegen::Gemm) -> SgemmCall {
        SgemmCall {
            dtype: g.dtype,
            transa: g.transa,
            transb: g.transb,
            m: g.m as usize,
            n: g.n as usize,
            k: g.k as usize,
            alpha: g.alpha,
            lda: g.lda as usize,
            stride_a: g.stride_a as usize,
            ldb: g.ldb as usize,
            stride_b: g.stride_b as usize,
            beta: g.beta,
            ldc: g.ldc as usize,
            stride_c: g.stride_c as usize,
            batch: g.batch as usize,
        }
    }
}
