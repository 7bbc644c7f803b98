//! The local halves of tensor parallelism (a mesh's model axis): a worker's part of a
//! split value, and the vocabulary-parallel lookup and its gradient. Which part is the
//! worker's comes from [`KArg::ModelRank`], an argument like the data rank, so one plan
//! serves every model rank and a captured graph replays with the right one. The
//! model-axis collectives themselves are host work ([`super::Launch::Host`]).

use super::{row_len, want_f32, want_i32, KArg, NodeCx, INDEX};

/// `model_split`: this worker's part along `dim` of `parts` equal parts, in rank order:
/// `rows` runs of `cols` words, the source's start moved by `rank * cols` words.
pub(crate) fn split(cx: &mut NodeCx<'_>, dim: usize, parts: usize) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    let dims = x.dims();
    if parts == 0 || dim >= dims.len() || dims[dim] % parts != 0 {
        return Err(format!(
            "dimension {dim} of {x} does not split into {parts} equal parts"
        ));
    }
    if y.shape.numel() * parts != x.shape.numel() || x.dtype != y.dtype {
        return Err(format!("the output {y} is not one of {parts} parts of {x}"));
    }
    let rows: usize = dims[..dim].iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let len = dims[dim] / parts;
    let cols = len * inner;
    // Words, not floats: ids (i32) split as floats do.
    let text = "extern \"C\" __global__ void KNAME(u32* y, const u32* x, u64 rows, u64 cols, u64 pitch, u32 rank) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    u64 r = i / cols, c = i - r * cols;
    y[i] = x[r * pitch + (u64)rank * cols + c];
}
"
    .to_string();
    let name = cx.kernel("model_split", text);
    let u = |v: usize| KArg::U64(v as u64);
    cx.launch_1d(
        &name,
        rows * cols,
        vec![
            KArg::Output(0),
            KArg::Input(0),
            u(rows),
            u(cols),
            u(dims[dim] * inner),
            KArg::ModelRank,
        ],
    )
}

/// `model_embedding`: the table is part `rank` of a table split by rows (rows
/// `rank * R .. (rank + 1) * R` of the whole): an id in that range reads its row, any
/// other id zeros. Summed over the parts, the whole table's lookup.
pub(crate) fn embedding(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let text = format!(
        "extern \"C\" __global__ void KNAME(const float* table, const int* ids, float* y, u64 n, u64 row, u64 rows, u32 rank) {{\n{INDEX}    long long local = (long long)ids[i / row] - (long long)rank * (long long)rows;\n    y[i] = (local >= 0 && (u64)local < rows) ? table[(u64)local * row + i % row] : 0.0f;\n}}\n"
    );
    super::sparse::lookup(cx, "model_embedding", text, Some(KArg::ModelRank))
}

/// Threads of the one block that scans the ids.
const SCAN_BLOCK: u32 = 1024;

/// `model_embedding_grad`: the ids in this part's range as local row numbers, with
/// their rows of `dy`, in the ids' order; other ids give no row (a lazily updated
/// optimizer leaves the rows they would name alone). One block scans the ids (each
/// kept id's slot into scratch, the indices and the count into the output), then one
/// thread per element of `dy` copies the kept rows.
pub(crate) fn embedding_grad(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (dy, ids) = (cx.tin(0)?.clone(), cx.tin(1)?.clone());
    want_f32(&dy, "dy")?;
    want_i32(&ids, "the ids")?;
    let (dense, nnz) = cx.sout(0)?;
    let (rows, row) = (dense.dims().first().copied().unwrap_or(0), row_len(dense));
    let k = ids.shape.numel();
    if dy.shape.numel() != k * row || nnz < k {
        return Err(format!(
            "dy {dy} and ids {ids} do not give at most {nnz} rows of {row}"
        ));
    }
    let scan = "extern \"C\" __global__ void KNAME(const int* ids, void* out, int* pos, u64 k, u64 rows, u32 rank) {
    __shared__ int sh[33];
    int carry = 0;
    long long first = (long long)rank * (long long)rows;
    for (u64 j0 = 0; j0 < k; j0 += blockDim.x) {
        u64 j = j0 + threadIdx.x;
        long long local = j < k ? (long long)ids[j] - first : -1;
        int flag = local >= 0 && (u64)local < rows;
        int total;
        int p = carry + block_scan(flag, sh, &total);
        if (j < k) pos[j] = flag ? p : -1;
        if (flag) sl_idx(out)[p] = (int)local;
        carry += total;
    }
    if (threadIdx.x == 0) *sl_count(out) = carry;
}
"
    .to_string();
    let copy = format!(
        "extern \"C\" __global__ void KNAME(const float* dy, const int* pos, void* out, u64 n, u64 row, u64 nnz) {{\n{INDEX}    int p = pos[i / row];\n    if (p >= 0) sl_val(out, nnz)[(u64)p * row + i % row] = dy[i];\n}}\n"
    );
    let scan = cx.kernel("model_embedding_grad_scan", scan);
    let copy = cx.kernel("model_embedding_grad_copy", copy);
    let pos = cx.scratch(4 * k.max(1));
    let u = |v: usize| KArg::U64(v as u64);
    cx.launch(
        &scan,
        [1, 1, 1],
        SCAN_BLOCK,
        vec![
            KArg::Input(1),
            KArg::Output(0),
            pos.clone(),
            u(k),
            u(rows),
            KArg::ModelRank,
        ],
    );
    let n = k * row;
    cx.launch_1d(
        &copy,
        n,
        vec![KArg::Input(0), pos, KArg::Output(0), u(n), u(row), u(nnz)],
    )
}
