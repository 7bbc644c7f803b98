//! Index maps baked into kernels: a linear index over an iteration shape becomes an
//! element offset into an operand (broadcasting, transposes, the kept and the reduced
//! axes of a reduction). [`StridedMap::offset`] computes in Rust exactly what
//! [`StridedMap::emit`] writes in C (the same divisions in the same order), so the
//! tests check the generated index arithmetic on the CPU.

/// A linear index over `dims`' sizes (row-major, outermost first) mapped to the sum of
/// each coordinate times its stride.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StridedMap {
    /// `(size, stride)` per dimension, outermost first.
    pub dims: Vec<(usize, usize)>,
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

impl StridedMap {
    /// The map of `(size, stride)` pairs, simplified: size-1 dimensions dropped, and a
    /// dimension merged into the one inside it where the strides allow
    /// (`outer stride == inner stride * inner size`), so a contiguous run is one
    /// dimension and costs one division.
    pub fn new(dims: impl IntoIterator<Item = (usize, usize)>) -> StridedMap {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (size, stride) in dims {
            if size == 1 {
                continue;
            }
            match out.last_mut() {
                Some((n, s)) if *s == stride * size => {
                    *n *= size;
                    *s = stride;
                }
                _ => out.push((size, stride)),
            }
        }
        StridedMap { dims: out }
    }

    /// Elements the map iterates over.
    pub fn len(&self) -> usize {
        self.dims.iter().map(|d| d.0).product()
    }

    /// Whether the map iterates over nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the offset is the linear index itself.
    pub fn is_identity(&self) -> bool {
        match self.dims.as_slice() {
            [] => true,
            [(_, 1)] => true,
            _ => false,
        }
    }

    /// The outermost dimension whose stride is not 0 (0 if none): the dimensions
    /// outside it add nothing, so neither Rust nor C decomposes them.
    fn outermost_read(&self) -> usize {
        self.dims.iter().position(|d| d.1 != 0).unwrap_or(0)
    }

    /// The offset of linear index `lin` (`lin < len()`), computed as [`Self::emit`]'s
    /// C does.
    pub fn offset(&self, lin: usize) -> usize {
        if self.is_identity() {
            return if self.dims.is_empty() { 0 } else { lin };
        }
        let mut off = 0;
        let mut r = lin;
        let outer = self.outermost_read();
        for (i, &(size, stride)) in self.dims.iter().enumerate().rev() {
            if i < outer {
                break;
            }
            if i == 0 {
                off += r * stride;
            } else if stride == 0 {
                r /= size;
            } else {
                off += (r % size) * stride;
                r /= size;
            }
        }
        off
    }

    /// C statements declaring `u64 {var}`, the offset of the linear index `lin` (a C
    /// expression of type u64).
    pub fn emit(&self, var: &str, lin: &str) -> String {
        if self.is_identity() {
            return if self.dims.is_empty() {
                format!("u64 {var} = 0;")
            } else {
                format!("u64 {var} = {lin};")
            };
        }
        let mut s = format!("u64 {var} = 0; {{ u64 r_ = {lin};");
        let outer = self.outermost_read();
        for (i, &(size, stride)) in self.dims.iter().enumerate().rev() {
            if i < outer {
                break;
            }
            if i == 0 {
                s.push_str(&format!(" {var} += r_ * {stride}ull;"));
            } else if stride == 0 {
                s.push_str(&format!(" r_ /= {size}ull;"));
            } else if i == outer {
                s.push_str(&format!(" {var} += (r_ % {size}ull) * {stride}ull;"));
            } else {
                s.push_str(&format!(
                    " {var} += (r_ % {size}ull) * {stride}ull; r_ /= {size}ull;"
                ));
            }
        }
        s.push_str(" }");
        s
    }
}

/// The map from a linear index over `to` to the element of a row-major `from` that
/// numpy broadcasting reads there (stride 0 along broadcast dimensions), or `None` if
/// `from` does not broadcast to `to`.
pub fn broadcast_map(from: &[usize], to: &[usize]) -> Option<StridedMap> {
    if from.len() > to.len() {
        return None;
    }
    let lead = to.len() - from.len();
    let st = strides(from);
    let mut dims = Vec::with_capacity(to.len());
    for (i, &n) in to.iter().enumerate() {
        if i < lead {
            dims.push((n, 0));
            continue;
        }
        let f = from[i - lead];
        if f == n {
            dims.push((n, st[i - lead]));
        } else if f == 1 {
            dims.push((n, 0));
        } else {
            return None;
        }
    }
    Some(StridedMap::new(dims))
}

/// The map from a linear index over the transposed shape to the input element, for
/// output axis `i` = input axis `perm[i]`.
pub(crate) fn transpose_map(input: &[usize], perm: &[usize]) -> StridedMap {
    let st = strides(input);
    StridedMap::new(perm.iter().map(|&p| (input[p], st[p])))
}

/// The maps of a reduction of `input` over `axes`: `(kept, reduced)`, each from its own
/// linear index to input offsets (the kept one in output order).
pub(crate) fn reduction_maps(input: &[usize], axes: &[usize]) -> (StridedMap, StridedMap) {
    let st = strides(input);
    let kept = (0..input.len())
        .filter(|a| !axes.contains(a))
        .map(|a| (input[a], st[a]));
    let red = (0..input.len())
        .filter(|a| axes.contains(a))
        .map(|a| (input[a], st[a]));
    (StridedMap::new(kept), StridedMap::new(red))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    /// Every offset of the map equals the position ndarray's broadcast reads.
    fn check_broadcast(from: &[usize], to: &[usize]) {
        let n: usize = from.iter().product();
        let a = ArrayD::from_shape_vec(IxDyn(from), (0..n).collect::<Vec<usize>>()).unwrap();
        let b = a.broadcast(IxDyn(to)).unwrap();
        let map = broadcast_map(from, to).unwrap();
        assert_eq!(map.len(), to.iter().product::<usize>());
        for (lin, &want) in b.iter().enumerate() {
            assert_eq!(map.offset(lin), want, "{from:?} -> {to:?} at {lin}: {map:?}");
        }
    }

    #[test]
    fn broadcast_offsets_match_ndarray() {
        check_broadcast(&[4], &[3, 4]);
        check_broadcast(&[3, 1], &[3, 4]);
        check_broadcast(&[1, 4], &[2, 3, 4]);
        check_broadcast(&[2, 1, 4], &[2, 3, 4]);
        check_broadcast(&[8, 1, 1], &[5, 8, 6, 7]);
        check_broadcast(&[], &[3, 2]);
        check_broadcast(&[3, 2], &[3, 2]);
        check_broadcast(&[1], &[1]);
        assert!(broadcast_map(&[3], &[4]).is_none());
        assert!(broadcast_map(&[2, 3], &[3]).is_none());
    }

    #[test]
    fn transpose_offsets_match_ndarray() {
        for (shape, perm) in [
            (vec![2, 3], vec![1, 0]),
            (vec![2, 3, 4], vec![2, 0, 1]),
            (vec![2, 3, 4, 5], vec![0, 2, 1, 3]),
            (vec![2, 3, 4], vec![0, 1, 2]),
        ] {
            let n: usize = shape.iter().product();
            let a = ArrayD::from_shape_vec(IxDyn(&shape), (0..n).collect::<Vec<usize>>()).unwrap();
            let t = a.view().permuted_axes(IxDyn(&perm));
            let map = transpose_map(&shape, &perm);
            for (lin, &want) in t.iter().enumerate() {
                assert_eq!(map.offset(lin), want, "{shape:?} {perm:?}");
            }
        }
    }

    #[test]
    fn reduction_maps_cover_each_element_once() {
        let shape = [3, 4, 5, 2];
        for axes in [vec![0], vec![1, 3], vec![0, 1, 2, 3], vec![2], vec![]] {
            let (kept, red) = reduction_maps(&shape, &axes);
            let mut seen = vec![0; shape.iter().product()];
            for o in 0..kept.len() {
                for r in 0..red.len() {
                    seen[kept.offset(o) + red.offset(r)] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{axes:?}");
            // The kept map walks the output in row-major order: increasing offsets.
            let offs: Vec<usize> = (0..kept.len()).map(|o| kept.offset(o)).collect();
            assert!(offs.windows(2).all(|w| w[0] < w[1]), "{axes:?}");
        }
    }

    #[test]
    fn merging_keeps_offsets_and_emits_what_it_computes() {
        let m = StridedMap::new([(2, 12), (3, 4), (4, 1)]);
        assert!(m.is_identity(), "{m:?}");
        let m = StridedMap::new([(2, 0), (3, 4), (4, 1)]);
        assert_eq!(m.dims, vec![(2, 0), (12, 1)]);
        assert_eq!(
            m.emit("o", "i"),
            "u64 o = 0; { u64 r_ = i; o += (r_ % 12ull) * 1ull; }"
        );
        assert_eq!(m.offset(13), 1);
        // Broadcast inner dimensions divide without adding.
        let m = StridedMap::new([(2, 1), (3, 0)]);
        assert_eq!(
            m.emit("o", "i"),
            "u64 o = 0; { u64 r_ = i; r_ /= 3ull; o += r_ * 1ull; }"
        );
        assert_eq!(m.offset(4), 1);
    }
}
