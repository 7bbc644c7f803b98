//! The geometry of a convolution, shared by every backend: the CPU kernels and the CUDA
//! code generator lay their loops out by the same one, so they agree on shapes.

fn shape_str(dims: &[usize]) -> String {
    distc_ir::Shape(dims.to_vec()).to_string()
}

/// The geometry of a convolution: `x [n,c,h,w]`, `w [o,c,kh,kw]`, output `[n,o,oh,ow]`
/// (the CUDA code generator lays its kernels out by the same one).
#[derive(Clone, Copy, Debug)]
pub struct ConvGeom {
    /// Images in the batch.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels (filters).
    pub o: usize,
    /// Filter height.
    pub kh: usize,
    /// Filter width.
    pub kw: usize,
    /// Stride, both axes.
    pub stride: usize,
    /// Zero padding, every side.
    pub pad: usize,
    /// Output height.
    pub oh: usize,
    /// Output width.
    pub ow: usize,
}

impl ConvGeom {
    /// The geometry of `x` convolved with `w`, or why they do not fit.
    pub fn new(x: &[usize], w: &[usize], stride: usize, pad: usize) -> Result<ConvGeom, String> {
        if x.len() != 4 || w.len() != 4 {
            return Err(format!(
                "needs x [N,C,H,W] and w [O,C,KH,KW], got {} and {}",
                shape_str(x),
                shape_str(w)
            ));
        }
        if x[1] != w[1] {
            return Err(format!(
                "channels differ: x {} has {}, w {} has {}",
                shape_str(x),
                x[1],
                shape_str(w),
                w[1]
            ));
        }
        if stride == 0 {
            return Err("stride must be at least 1".into());
        }
        let (ph, pw) = (x[2] + 2 * pad, x[3] + 2 * pad);
        if w[2] > ph || w[3] > pw || w[2] == 0 || w[3] == 0 {
            return Err(format!(
                "filter {} does not fit the padded input {}",
                shape_str(w),
                shape_str(x)
            ));
        }
        Ok(ConvGeom {
            n: x[0],
            c: x[1],
            h: x[2],
            w: x[3],
            o: w[0],
            kh: w[2],
            kw: w[3],
            stride,
            pad,
            oh: (ph - w[2]) / stride + 1,
            ow: (pw - w[3]) / stride + 1,
        })
    }

    /// Rows of the column matrix: `c * kh * kw`.
    pub fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }
    /// Output positions per image: `oh * ow`.
    pub fn p(&self) -> usize {
        self.oh * self.ow
    }
    /// Elements of one input image.
    pub fn chw(&self) -> usize {
        self.c * self.h * self.w
    }
    /// The output's dimensions `[n, o, oh, ow]`.
    pub fn out_dims(&self) -> [usize; 4] {
        [self.n, self.o, self.oh, self.ow]
    }
}
