//! Embedding lookups and row-sparse `IndexedSlices` on the device (buffer layout in
//! the module doc of `codegen`): the lookup and its gradient, joining, densifying,
//! masking and summing repeated rows, and gradient accumulation.
//!
//! Row counts stay on the device: a kernel reads `count` from the buffer, and grids
//! are sized for the type's `nnz` bound, threads past `count` doing nothing.
//!
//! **Repeated rows** ([`unique_launches`]) are summed deterministically, in the order
//! the CPU sums them, in work proportional to the lookups: (1) a `V`-sized scratch
//! gets each row id's first position by `atomicMin` (an integer minimum: the same
//! result whatever the order) and its number of occurrences by `atomicAdd`; (2) one
//! block scans the positions, keeping each id's first occurrence, so unique rows come
//! in first-occurrence order, and gives each its slot and, by a scan of the counts,
//! the start of its list of positions; (3) one thread per position appends itself to
//! its id's list (in any order); (4) one block per unique row sorts its list in
//! shared memory (bitonic), which restores the order of appearance, and adds the rows
//! in that order with up to 32 rows' loads in flight at once ([`LOADS_AHEAD`]). An id
//! seen more than [`SORT_CAP`] times in one batch is summed by scanning the batch from
//! its first occurrence instead (a ballot and a block scan per chunk). No float atomics, so the
//! sums have the same bits every run. `unique_rows`, `densify` and the sparse
//! optimizer updates share steps (1)-(4) and differ only in what step (4) writes.

use super::{row_len, want_f32, want_i32, KArg, Launch, NodeCx, INDEX};

/// Most column accumulators a thread keeps while summing a row's occurrences; wider
/// rows are done in tiles of `block * MAX_COLS` columns (each tile scans again).
const MAX_COLS: usize = 8;
/// Rows of one id whose loads are issued before the first is added (in order), in
/// rounds of 32, then 8, then the rest (fewer than 8) at once: a hot id (Zipf's first
/// ids, a tenth of a batch's lookups) otherwise waits out one memory latency per
/// occurrence, which on an H100 made W1's sparse update 99 µs of a 176 µs step.
const LOADS_AHEAD: [usize; 2] = [32, 8];
/// Most occurrences of one id sorted in shared memory (16 KiB); an id seen more often
/// in one batch is summed by scanning the batch from its first occurrence instead.
pub(crate) const SORT_CAP: usize = 4096;

/// `(table [V, ..], ids) -> [ids.., table.dims[1..]]`: one thread per output element;
/// an id outside the table reads zeros.
pub(crate) fn embedding(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let text = format!(
        "extern \"C\" __global__ void KNAME(const float* table, const int* ids, float* y, u64 n, u64 row, u64 rows) {{\n{INDEX}    int id = ids[i / row];\n    y[i] = (id >= 0 && (u64)id < rows) ? table[(u64)id * row + i % row] : 0.0f;\n}}\n"
    );
    lookup(cx, "embedding", text, None)
}

/// A lookup kernel `text` (named from `base`) of the table (input 0) by the ids
/// (input 1), checked and launched one thread per output element with
/// `(table, ids, y, n, row, rows)` and, where given, a last argument.
pub(crate) fn lookup(
    cx: &mut NodeCx<'_>,
    base: &str,
    text: String,
    last: Option<KArg>,
) -> Result<(), String> {
    let (table, ids, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    want_f32(&table, "the table")?;
    want_i32(&ids, "the ids")?;
    if table.dims().len() < 2 {
        return Err(format!("the table must have rank 2 or more, got {table}"));
    }
    let (rows, row) = (table.dims()[0], row_len(&table));
    let n = ids.shape.numel() * row;
    if y.shape.numel() != n {
        return Err(format!("the output {y} does not hold {ids} rows of {row}"));
    }
    let name = cx.kernel(base, text);
    let mut args = vec![
        KArg::Input(0),
        KArg::Input(1),
        KArg::Output(0),
        KArg::U64(n as u64),
        KArg::U64(row as u64),
        KArg::U64(rows as u64),
    ];
    args.extend(last);
    cx.launch_1d(&name, n, args)
}

/// `(dy, ids) -> IndexedSlices`: the ids as indices, `dy`'s rows as values (repeats
/// kept), the count set to the number of ids. One thread per value element.
pub(crate) fn embedding_grad(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (dy, ids) = (cx.tin(0)?.clone(), cx.tin(1)?.clone());
    want_f32(&dy, "dy")?;
    want_i32(&ids, "the ids")?;
    let (dense, nnz) = cx.sout(0)?;
    let row = row_len(dense);
    if nnz != ids.shape.numel() || dy.shape.numel() != nnz * row {
        return Err(format!(
            "dy {dy} and ids {ids} do not give {nnz} rows of {row}"
        ));
    }
    let text = format!(
        "extern \"C\" __global__ void KNAME(const float* dy, const int* ids, void* out, u64 nnz, u64 row, u64 n) {{\n{INDEX}    if (i < nnz * row) sl_val(out, nnz)[i] = dy[i];\n    if (i < nnz) sl_idx(out)[i] = ids[i];\n    if (i == 0) *sl_count(out) = (int)nnz;\n}}\n"
    );
    let name = cx.kernel("embedding_grad", text);
    let n = (nnz * row).max(nnz).max(1);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Output(0),
            KArg::U64(nnz as u64),
            KArg::U64(row as u64),
            KArg::U64(n as u64),
        ],
    )
}

/// Appends the rows of slices `src` (bound `snnz`) to `dst` (bound `dnnz`) after the
/// `*sl_count(dst)` rows it holds, values scaled by `scale`; the count is advanced by
/// [`BUMP`] after. One thread per value element of the source's bound.
const APPEND: &str = "extern \"C\" __global__ void KNAME(void* dst, const void* src, u64 dnnz, u64 snnz, u64 row, float scale) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 k = i / row, c = i % row;
    u64 count = (u64)*sl_count((void*)src), base = (u64)*sl_count(dst);
    if (k >= count || base + k >= dnnz) return;
    sl_val(dst, dnnz)[(base + k) * row + c] = sl_val((void*)src, snnz)[i] * scale;
    if (c == 0) sl_idx(dst)[base + k] = sl_idx((void*)src)[k];
}
";

/// Adds the source's count to the destination's (capped at the destination's bound).
const BUMP: &str = "extern \"C\" __global__ void KNAME(void* dst, const void* src, u64 dnnz) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        u64 c = (u64)*sl_count(dst) + (u64)*sl_count((void*)src);
        *sl_count(dst) = (int)(c < dnnz ? c : dnnz);
    }
}
";

/// Appends slices input `i` to output 0 (see [`APPEND`]) and advances the count.
fn append(cx: &mut NodeCx<'_>, i: usize, scale: f32) -> Result<(), String> {
    let (sd, snnz) = cx.sin(i)?;
    let (dd, dnnz) = cx.sout(0)?;
    if sd != dd {
        return Err(format!("input {i} stands for {sd}, the output for {dd}"));
    }
    want_f32(sd, &format!("input {i}"))?;
    let row = row_len(sd);
    let append = cx.kernel("slices_append", APPEND.to_string());
    let bump = cx.kernel("slices_bump", BUMP.to_string());
    let u = |v: usize| KArg::U64(v as u64);
    cx.launch_1d(
        &append,
        snnz * row,
        vec![
            KArg::Output(0),
            KArg::Input(i),
            u(dnnz),
            u(snnz),
            u(row),
            KArg::F32(scale),
        ],
    )?;
    cx.launch(
        &bump,
        [1, 1, 1],
        32,
        vec![KArg::Output(0), KArg::Input(i), u(dnnz)],
    );
    Ok(())
}

/// Joins slices over one dense type: the count zeroed, then each input appended.
pub(crate) fn concat_slices(cx: &mut NodeCx<'_>) -> Result<(), String> {
    cx.out.launches.push(Launch::Memset {
        buf: KArg::Output(0),
        bytes: 4,
    });
    for i in 0..cx.ins.len() {
        append(cx, i, 1.0)?;
    }
    Ok(())
}

/// Gradient accumulation over `micro` micro-batches: the output buffer lives across a
/// step's micro-batches (cleared by the node's `step_start` launches) and each run
/// adds `input / micro` into it, so after the last it holds the mean. Slices are
/// appended (values scaled by `1/micro`), as the CPU concatenates them.
pub(crate) fn accumulate(cx: &mut NodeCx<'_>, micro: usize) -> Result<(), String> {
    if micro == 0 {
        return Err("needs at least one micro-batch".into());
    }
    let scale = (1.0 / micro as f64) as f32;
    if cx.sin(0).is_ok() {
        cx.out.step_start.push(Launch::Memset {
            buf: KArg::Output(0),
            bytes: 4,
        });
        return append(cx, 0, scale);
    }
    let x = cx.tin(0)?.clone();
    want_f32(&x, "input 0")?;
    let n = x.shape.numel();
    cx.out.step_start.push(Launch::Memset {
        buf: KArg::Output(0),
        bytes: (4 * n) as u64,
    });
    let text = format!(
        "extern \"C\" __global__ void KNAME(const float* x, float* y, float scale, u64 n) {{\n{INDEX}    y[i] += x[i] * scale;\n}}\n"
    );
    let name = cx.kernel("accumulate", text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::F32(scale),
            KArg::U64(n as u64),
        ],
    )
}

/// `IndexedSlices [R, ..] -> f32[R]`: zeros, then 1 at each row held.
pub(crate) fn row_mask(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (dense, nnz) = cx.sin(0)?;
    let rows = dense.dims().first().copied().unwrap_or(0);
    let y = cx.tout(0)?.clone();
    if y.dims() != [rows] {
        return Err(format!(
            "the output {y} is not one element per row of {dense}"
        ));
    }
    cx.out.launches.push(Launch::Memset {
        buf: KArg::Output(0),
        bytes: (4 * rows) as u64,
    });
    let text = "extern \"C\" __global__ void KNAME(const void* s, float* mask, u64 nnz, u64 rows) {
    u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nnz || k >= (u64)*sl_count((void*)s)) return;
    int id = sl_idx((void*)s)[k];
    if (id >= 0 && (u64)id < rows) mask[id] = 1.0f;
}
"
    .to_string();
    let name = cx.kernel("row_mask", text);
    cx.launch_1d(
        &name,
        nnz,
        vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U64(nnz as u64),
            KArg::U64(rows as u64),
        ],
    )
}

/// Rows of the table a slices value stands for (an error, not a panic, for a
/// rank-0 dense type from a hand-edited plan).
fn table_rows(dense: &distc_ir::TensorType) -> Result<usize, String> {
    dense
        .dims()
        .first()
        .copied()
        .ok_or_else(|| format!("slices must stand for a table of rank 1 or more, not {dense}"))
}

/// Threads of the single-block scans.
const SCAN_BLOCK: u32 = 1024;

/// `(dense [R, ..], mask [R]) -> IndexedSlices`: the rows whose mask is not zero, in
/// row order. One block scans the mask (row positions into scratch, indices and count
/// into the output), then one thread per element copies the kept rows.
pub(crate) fn sparsify(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, mask) = (cx.tin(0)?.clone(), cx.tin(1)?.clone());
    want_f32(&x, "input 0")?;
    let rows = x.dims().first().copied().unwrap_or(0);
    if x.dims().is_empty() || mask.dims() != [rows] {
        return Err(format!(
            "the mask {mask} must have one element per row of {x}"
        ));
    }
    let (dense, nnz) = cx.sout(0)?;
    if dense != &x {
        return Err(format!("the output stands for {dense}, the input is {x}"));
    }
    let row = row_len(&x);
    let scan = "extern \"C\" __global__ void KNAME(const float* mask, void* out, int* pos, u64 rows, u64 nnz) {
    __shared__ int sh[33];
    int carry = 0;
    for (u64 r0 = 0; r0 < rows; r0 += blockDim.x) {
        u64 r = r0 + threadIdx.x;
        int flag = r < rows && mask[r] != 0.0f;
        int total;
        int p = carry + block_scan(flag, sh, &total);
        if (r < rows) pos[r] = flag && (u64)p < nnz ? p : -1;
        if (flag && (u64)p < nnz) sl_idx(out)[p] = (int)r;
        carry += total;
    }
    if (threadIdx.x == 0) *sl_count(out) = (u64)carry < nnz ? carry : (int)nnz;
}
"
    .to_string();
    let copy = format!(
        "extern \"C\" __global__ void KNAME(const float* x, const int* pos, void* out, u64 n, u64 row, u64 nnz) {{\n{INDEX}    int p = pos[i / row];\n    if (p >= 0) sl_val(out, nnz)[(u64)p * row + i % row] = x[i];\n}}\n"
    );
    let scan = cx.kernel("sparsify_scan", scan);
    let copy = cx.kernel("sparsify_copy", copy);
    let pos = cx.scratch(4 * rows);
    let u = |v: usize| KArg::U64(v as u64);
    cx.launch(
        &scan,
        [1, 1, 1],
        SCAN_BLOCK,
        vec![
            KArg::Input(1),
            KArg::Output(0),
            pos.clone(),
            u(rows),
            u(nnz),
        ],
    );
    let n = rows * row;
    cx.launch_1d(
        &copy,
        n,
        vec![KArg::Input(0), pos, KArg::Output(0), u(n), u(row), u(nnz)],
    )
}

/// What the last step of the repeated-row machinery does with each unique row.
pub(crate) struct UniqueSink {
    /// Base name of the kernel.
    pub(crate) base: &'static str,
    /// Extra kernel parameters (C declarations, each with a leading `, `).
    pub(crate) params: String,
    /// C run once per unique row by thread 0: `u` is its position, `id` its row id.
    pub(crate) per_row: String,
    /// C run per column: `c` the column, `g` the summed value, plus `u`, `id`.
    pub(crate) per_col: String,
    /// Launch arguments after the fixed ones (matching `params`).
    pub(crate) args: Vec<KArg>,
}

/// The launches that sum the repeated rows of slices `src` (row ids in `0..rows`,
/// `row` elements each, bound `nnz`) and hand each unique row to `sink`. `count_out`
/// receives the number of unique rows (an `int*`: a scratch, or a slices output whose
/// count sits at offset 0). Returns the launches' scratch needs through `cx`.
pub(crate) fn unique_launches(
    cx: &mut NodeCx<'_>,
    src: KArg,
    (rows, row, nnz): (usize, usize, usize),
    count_out: Option<KArg>,
    sink: UniqueSink,
) -> Result<(), String> {
    let first = cx.scratch(4 * rows);
    // Occurrences per id from `claim`; `leaders` then overwrites each id's entry with
    // its unique slot, which `fill` reads.
    let tally = cx.scratch(4 * rows);
    let lead = cx.scratch(4 * nnz);
    let start = cx.scratch(4 * (nnz + 1));
    let cursor = cx.scratch(4 * nnz);
    let list = cx.scratch(4 * nnz);
    let count = match count_out {
        Some(k) => k,
        None => cx.scratch(4),
    };
    let u = |v: usize| KArg::U64(v as u64);
    let reset = format!(
        "extern \"C\" __global__ void KNAME(int* first, int* tally, u64 n) {{\n{INDEX}    first[i] = 0x7fffffff;\n    tally[i] = 0;\n}}\n"
    );
    let claim = "extern \"C\" __global__ void KNAME(const void* s, int* first, int* tally, u64 nnz, u64 rows) {
    u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nnz || k >= (u64)*sl_count((void*)s)) return;
    int id = sl_idx((void*)s)[k];
    if (id >= 0 && (u64)id < rows) {
        atomicMin(&first[id], (int)k);
        atomicAdd(&tally[id], 1);
    }
}
"
    .to_string();
    let leaders = "extern \"C\" __global__ void KNAME(const void* s, const int* first, int* tally, int* lead, int* start, int* cursor, int* ucount, u64 nnz, u64 rows) {
    __shared__ int sh[33];
    u64 count = (u64)*sl_count((void*)s);
    if (count > nnz) count = nnz;
    int carry = 0, offset = 0;
    for (u64 k0 = 0; k0 < count; k0 += blockDim.x) {
        u64 k = k0 + threadIdx.x;
        int flag = 0, n = 0, id = -1;
        if (k < count) {
            id = sl_idx((void*)s)[k];
            flag = id >= 0 && (u64)id < rows && first[id] == (int)k;
            if (flag) n = tally[id];
        }
        int total, ntotal;
        int p = carry + block_scan(flag, sh, &total);
        int o = offset + block_sum_scan(n, sh, &ntotal);
        if (flag) { lead[p] = (int)k; start[p] = o; cursor[p] = 0; tally[id] = p; }
        carry += total;
        offset += ntotal;
    }
    if (threadIdx.x == 0) { *ucount = carry; start[carry] = offset; }
}
"
    .to_string();
    // Positions are taken last first: on a GPU the appends come in any order, and the
    // emulator, which runs threads in order, then hands the sort reversed lists.
    let fill = "extern \"C\" __global__ void KNAME(const void* s, const int* slot, const int* start, int* cursor, int* list, u64 nnz, u64 rows) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 count = (u64)*sl_count((void*)s);
    if (count > nnz) count = nnz;
    if (t >= count) return;
    u64 k = count - 1 - t;
    int id = sl_idx((void*)s)[k];
    if (id >= 0 && (u64)id < rows) {
        int u = slot[id];
        list[start[u] + atomicAdd(&cursor[u], 1)] = (int)k;
    }
}
"
    .to_string();
    let block = (row.div_ceil(32) * 32).clamp(32, 256);
    let cols = row.div_ceil(block).clamp(1, MAX_COLS);
    let tile = block * cols;
    // Adds the rows at positions `pos[0..total)` (in that order) into `acc`.
    let add_listed = |pos: &str| {
        let mut text = "int m = 0;".to_string();
        for ahead in LOADS_AHEAD {
            text.push_str(&format!(
                "
            for (; m + {ahead} <= total; m += {ahead}) {{
                for (int t = 0; t < {cols}; ++t) {{
                    u64 c = c0 + (u64)t * {block}ull + threadIdx.x;
                    if (c < {row}ull) {{
                        float v[{ahead}];
                        for (int j = 0; j < {ahead}; ++j) v[j] = val[(u64){pos}[m + j] * {row}ull + c];
                        for (int j = 0; j < {ahead}; ++j) acc[t] += v[j];
                    }}
                }}
            }}"
            ));
        }
        // The last few in one round too: loads past the list are skipped, and so are
        // their adds (adding a zero would turn a -0 sum into +0).
        let last = LOADS_AHEAD[LOADS_AHEAD.len() - 1];
        text.push_str(&format!(
            "
            if (m < total) {{
                int rest = total - m;
                for (int t = 0; t < {cols}; ++t) {{
                    u64 c = c0 + (u64)t * {block}ull + threadIdx.x;
                    if (c < {row}ull) {{
                        float v[{last}];
                        for (int j = 0; j < {last}; ++j) if (j < rest) v[j] = val[(u64){pos}[m + j] * {row}ull + c];
                        for (int j = 0; j < {last}; ++j) if (j < rest) acc[t] += v[j];
                    }}
                }}
            }}"
        ));
        text
    };
    let tile_open = format!(
        "for (u64 c0 = 0; c0 < {row}ull; c0 += {tile}ull) {{
            float acc[{cols}];
            for (int t = 0; t < {cols}; ++t) acc[t] = 0.0f;"
    );
    let tile_close = format!(
        "for (int t = 0; t < {cols}; ++t) {{
                u64 c = c0 + (u64)t * {block}ull + threadIdx.x;
                if (c < {row}ull) {{ float g = acc[t]; {per_col} }}
            }}
        }}",
        per_col = sink.per_col,
    );
    let gather = format!(
        "// sum repeated rows of {row} elements: {base}
extern \"C\" __global__ void KNAME(const void* s, const int* lead, const int* start, const int* list, const int* ucount, u64 nnz{params}) {{
    __shared__ int sh[33];
    __shared__ int order[{SORT_CAP}];
    u64 u = blockIdx.x;
    if (u >= (u64)*ucount) return;
    u64 count = (u64)*sl_count((void*)s);
    if (count > nnz) count = nnz;
    const int* idx = sl_idx((void*)s);
    const float* val = sl_val((void*)s, nnz);
    u64 k0 = (u64)lead[u];
    int id = idx[k0];
    int from = start[u], len = start[u + 1] - from;
    if (threadIdx.x == 0) {{ {per_row} }}
    if (len <= {SORT_CAP}) {{
        // The id's positions, filled in any order: sorted, they are the order of appearance.
        int n2 = 1;
        while (n2 < len) n2 <<= 1;
        for (int i = threadIdx.x; i < n2; i += blockDim.x) order[i] = i < len ? list[from + i] : 0x7fffffff;
        __syncthreads();
        for (int size = 2; size <= n2; size <<= 1) {{
            for (int stride = size >> 1; stride > 0; stride >>= 1) {{
                for (int i = threadIdx.x; i < (n2 >> 1); i += blockDim.x) {{
                    int lo = 2 * stride * (i / stride) + i % stride, hi = lo + stride;
                    int a = order[lo], b = order[hi];
                    if ((a > b) == ((lo & size) == 0)) {{ order[lo] = b; order[hi] = a; }}
                }}
                __syncthreads();
            }}
        }}
        int total = len;
        {tile_open}
            {sorted_add}
            {tile_close}
    }} else {{
        // Too many to sort in shared memory: scan the positions from the first one,
        // a chunk at a time, keeping this id's.
        __shared__ int chunk[{block}];
        {tile_open}
            for (u64 b0 = k0; b0 < count; b0 += {block}ull) {{
                u64 k = b0 + threadIdx.x;
                int total;
                int flag = k < count && idx[k] == id;
                int p = block_scan(flag, sh, &total);
                if (flag) chunk[p] = (int)k;
                __syncthreads();
                {chunk_add}
                __syncthreads();
            }}
            {tile_close}
    }}
}}
",
        base = sink.base,
        params = sink.params,
        per_row = sink.per_row,
        sorted_add = add_listed("order"),
        chunk_add = add_listed("chunk"),
    );
    let reset = cx.kernel("unique_reset", reset);
    let claim = cx.kernel("unique_claim", claim);
    let leaders = cx.kernel("unique_leaders", leaders);
    let fill = cx.kernel("unique_fill", fill);
    let gather = cx.kernel(sink.base, gather);
    cx.launch_1d(&reset, rows, vec![first.clone(), tally.clone(), u(rows)])?;
    cx.launch_1d(
        &claim,
        nnz,
        vec![src.clone(), first.clone(), tally.clone(), u(nnz), u(rows)],
    )?;
    cx.launch(
        &leaders,
        [1, 1, 1],
        SCAN_BLOCK,
        vec![
            src.clone(),
            first,
            tally.clone(),
            lead.clone(),
            start.clone(),
            cursor.clone(),
            count.clone(),
            u(nnz),
            u(rows),
        ],
    );
    cx.launch_1d(
        &fill,
        nnz,
        vec![
            src.clone(),
            tally,
            start.clone(),
            cursor,
            list.clone(),
            u(nnz),
            u(rows),
        ],
    )?;
    if nnz > 0 {
        let grid = u32::try_from(nnz).map_err(|_| format!("{nnz} rows are too many blocks"))?;
        let mut args = vec![src, lead, start, list, count, u(nnz)];
        args.extend(sink.args);
        cx.launch(&gather, [grid, 1, 1], block as u32, args);
    }
    Ok(())
}

/// Slices with each row id once, its rows summed in order of appearance; unique rows
/// in first-occurrence order (the CPU's order).
pub(crate) fn unique_rows(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (sd, snnz) = cx.sin(0)?;
    let (sd, snnz) = (sd.clone(), snnz);
    want_f32(&sd, "input 0")?;
    let rows = table_rows(&sd)?;
    let (dd, dnnz) = cx.sout(0)?;
    if dd != &sd || dnnz < snnz.min(rows) {
        return Err(format!(
            "the output ({dd}, nnz {dnnz}) cannot hold the unique rows of the input ({sd}, nnz {snnz})"
        ));
    }
    let row = row_len(&sd);
    let sink = UniqueSink {
        base: "unique_rows",
        params: ", void* out, u64 onnz".into(),
        per_row: "sl_idx(out)[u] = id;".into(),
        per_col: format!("sl_val(out, onnz)[u * {row}ull + c] = g;"),
        args: vec![KArg::Output(0), KArg::U64(dnnz as u64)],
    };
    unique_launches(
        cx,
        KArg::Input(0),
        (rows, row, snnz),
        Some(KArg::Output(0)),
        sink,
    )
}

/// The dense tensor the slices stand for: zeros, then each unique row's sum written
/// to its row (repeated rows summed in order, as the CPU does).
pub(crate) fn densify(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (sd, snnz) = cx.sin(0)?;
    let sd = sd.clone();
    want_f32(&sd, "input 0")?;
    let rows = table_rows(&sd)?;
    let y = cx.tout(0)?.clone();
    if y != sd {
        return Err(format!("the output {y} is not the dense {sd}"));
    }
    cx.out.launches.push(Launch::Memset {
        buf: KArg::Output(0),
        bytes: y.bytes() as u64,
    });
    let row = row_len(&sd);
    let sink = UniqueSink {
        base: "densify",
        params: ", float* y".into(),
        per_row: String::new(),
        per_col: format!("y[(u64)id * {row}ull + c] = g;"),
        args: vec![KArg::Output(0)],
    };
    unique_launches(cx, KArg::Input(0), (rows, row, snnz), None, sink)
}
