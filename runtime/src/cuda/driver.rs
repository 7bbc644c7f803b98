//! The CUDA backend's driver boundary (issue 21): everything [`super::CudaBackend`]
//! asks of a GPU goes through [`Driver`], and every collective through [`DeviceComm`].
//!
//! Two implementations: [`CudarcDriver`], the real one (the CUDA driver, cuBLAS and
//! NCCL through cudarc, the calls the backend made before the seam existed), and
//! [`super::emu::EmuDriver`], which runs the same requests on the CPU and checks what
//! a GPU punishes only sometimes. The seam is a trait inside the backend rather than
//! stand-in driver libraries because the emulator needs the kernels' CUDA C source
//! (it compiles them with the system C++ compiler), which a driver library only sees
//! as a CUBIN.
//!
//! The backend addresses device memory by `u64` addresses, as the driver does; a
//! driver owns every buffer it allocated until it is dropped. A launch passes each
//! argument by value in its C type ([`ArgVal`]) and, for a driver that checks memory
//! ([`Driver::checks_accesses`]), the bytes each pointer argument may touch and how
//! ([`Region`]); the real driver is never asked to build them.

use super::nccl::NcclComm;
use super::{drv_err, nvrtc, CudaError};
use crate::comm::ByteCount;
use crate::cuda::emu::blas::SgemmCall;
use cudarc::cublas::{result as cublas_result, sys as cublas_sys};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule,
    CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use distc_ir::{DType, NodeId, Op, ValueType};
use std::sync::Arc;

/// A kernel argument by value, in the C type the codegen doc gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArgVal {
    /// A pointer or a 64-bit integer.
    U64(u64),
    /// An `int`.
    I32(i32),
    /// An `unsigned`.
    U32(u32),
    /// A `float`.
    F32(f32),
}

/// A loaded kernel: its module and its place in the names given to
/// [`Driver::load_module`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelHandle {
    /// The module.
    pub module: u32,
    /// The kernel within it.
    pub index: u32,
}

/// A pinned host buffer of the driver's, with the event of its last copy in or out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostBuf(pub usize);

/// How a launch may use a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read, all of it written before.
    Read,
    /// Read; only its leading `i32` row count need be written (an `IndexedSlices`
    /// value holds rows beyond its count that nothing wrote).
    ReadCounted,
    /// Written, and possibly read after it was written (outputs, scratch).
    Write,
    /// Read and written in place (a variable or an optimizer slot).
    ReadWrite,
    /// Read and written in place; only its leading `i32` row count need be written (an
    /// `IndexedSlices` gradient unscaled in place).
    ReadWriteCounted,
    /// Rows appended after its leading `i32` row count, which must be written (an
    /// `IndexedSlices` accumulator).
    Append,
}

/// The bytes a pointer argument may touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The argument's position in the launch.
    pub arg: usize,
    /// Bytes from the pointer.
    pub bytes: usize,
    /// How.
    pub access: Access,
}

/// One kernel launch, as `cuLaunchKernel` takes it.
pub struct KernelLaunch<'a> {
    /// The kernel.
    pub kernel: KernelHandle,
    /// Its name (for errors).
    pub name: &'a str,
    /// Blocks.
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: [u32; 3],
    /// Dynamic shared memory.
    pub shared_bytes: u32,
    /// The arguments, in the kernel's parameter order.
    pub args: &'a [ArgVal],
    /// The pointer arguments' extents (empty unless [`Driver::checks_accesses`]).
    pub regions: &'a [Region],
    /// What the launch is for (the node or update), for errors: made only when one
    /// is reported, so a launch formats nothing.
    pub what: &'a dyn Fn() -> String,
}

/// A strided-batched SGEMM and the bytes each of its matrices' buffers holds from the
/// pointer (`[a, b, c]`, known to a checking driver; zeros otherwise).
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    /// cuBLAS's parameters.
    pub call: SgemmCall,
    /// The buffers.
    pub a: u64,
    /// The second factor.
    pub b: u64,
    /// The result.
    pub c: u64,
    /// Bytes each buffer holds from its pointer (`[a, b, c]`).
    pub bytes: [usize; 3],
}

/// What the backend asks of one GPU (see the module doc). Work is ordered on one
/// compute stream; copies to the host through [`Driver::read`] return when done.
pub trait Driver {
    /// The device's name, as `NVIDIA H100 80GB HBM3`.
    fn device_name(&self) -> &str;
    /// The architecture the kernels are built for, as `sm_90`.
    fn arch(&self) -> &str;
    /// The device's UUID bytes.
    fn uuid(&self) -> Result<[u8; 16], CudaError>;
    /// Makes the device current on the calling thread.
    fn bind(&self) -> Result<(), CudaError>;
    /// A driver of the same device on the same stream, with kernels, host buffers and
    /// a graph of its own: each one's buffers are the other's to read, in issue order.
    /// For a second program of one worker (a pipeline stage's forward beside its
    /// backward, sharing the variables and the batch).
    fn sibling(&self) -> Result<Box<dyn Driver>, CudaError>;
    /// Whether launches must carry their [`Region`]s (the emulator checks them).
    fn checks_accesses(&self) -> bool {
        false
    }

    /// Compiles `source` (named `file` in logs) and loads the kernels `names`, in
    /// that order.
    fn load_module(
        &mut self,
        source: &str,
        file: &str,
        names: &[String],
    ) -> Result<Vec<KernelHandle>, CudaError>;
    /// Launches a kernel on the compute stream.
    fn launch(&mut self, k: &KernelLaunch<'_>) -> Result<(), CudaError>;
    /// A cuBLAS strided-batched SGEMM on the compute stream.
    fn sgemm(&mut self, g: &Gemm, what: &dyn Fn() -> String) -> Result<(), CudaError>;

    /// `bytes` of device memory (at least 256), zeroed or uninitialised.
    fn alloc(&mut self, bytes: usize, zeroed: bool) -> Result<u64, CudaError>;
    /// Copies `src` to device address `dst` (the driver stages pageable memory, so
    /// `src` may be reused at once).
    fn htod(&mut self, dst: u64, src: &[u8]) -> Result<(), CudaError>;
    /// Copies `dst.len()` bytes at `src` to the host, after all work issued so far.
    fn read(&mut self, src: u64, dst: &mut [u8]) -> Result<(), CudaError>;
    /// Zeroes `bytes` at `dst`, on the compute stream.
    fn memset_zero(&mut self, dst: u64, bytes: usize) -> Result<(), CudaError>;
    /// Copies `bytes` at device address `src` to `dst`, on the compute stream.
    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError>;
    /// Marks `bytes` at `dst` as holding nothing yet: a node's outputs and scratch
    /// before it runs. Nothing on a GPU; the emulator poisons them, so that a value
    /// its producer did not write is read as never written.
    fn fresh(&mut self, _dst: u64, _bytes: usize) -> Result<(), CudaError> {
        Ok(())
    }

    /// A pinned host buffer of `bytes`.
    fn host_buffer(&mut self, bytes: usize) -> Result<HostBuf, CudaError>;
    /// The buffer's bytes, once its last copy (an upload out of it, a download into
    /// it) has finished.
    fn host_bytes(&mut self, b: HostBuf) -> Result<&mut [u8], CudaError>;
    /// Copies the first `bytes` of `b` to `dst` on the compute stream, and records the
    /// buffer's event.
    fn upload(&mut self, b: HostBuf, dst: u64, bytes: usize) -> Result<(), CudaError>;
    /// Copies `bytes` at `src` into `b` on the compute stream, and records the
    /// buffer's event: [`Driver::host_bytes`] then waits for this copy alone.
    fn download(&mut self, b: HostBuf, src: u64, bytes: usize) -> Result<(), CudaError>;
    /// Waits for all work issued on the compute stream.
    fn synchronize(&mut self) -> Result<(), CudaError>;
    /// Records a time mark on the compute stream, after the work issued so far.
    fn mark(&mut self) -> Result<(), CudaError>;
    /// Waits for the compute stream; the seconds from the first mark since the last
    /// call to each mark, in order. The marks are then forgotten.
    fn mark_times(&mut self) -> Result<Vec<f64>, CudaError>;

    /// Starts capturing the compute stream into a graph.
    fn begin_capture(&mut self) -> Result<(), CudaError>;
    /// Ends the capture and instantiates the graph; `false` if it is empty.
    fn end_capture(&mut self) -> Result<bool, CudaError>;
    /// Launches the graph captured last.
    fn replay(&mut self) -> Result<(), CudaError>;

    /// Joins the communicator of `size` ranks named by `id` as `rank`.
    fn communicator(
        &mut self,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<Box<dyn DeviceComm>, CudaError>;
}

/// The plan's collectives on device buffers, on a stream of the communicator's own.
pub trait DeviceComm {
    /// Issues node `node`'s collective `op` of the value at `input` (type `in_ty`)
    /// into `output` (type `out_ty`), after the work issued on the compute stream.
    #[allow(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        node: NodeId,
        op: &Op,
        input: u64,
        in_ty: &ValueType,
        output: u64,
        out_ty: &ValueType,
    ) -> Result<(), CudaError>;
    /// Makes the compute stream wait for node `node`'s collective.
    fn order_after(&mut self, node: NodeId) -> Result<(), CudaError>;
    /// The bytes the collectives issued so far move.
    fn bytes(&self) -> ByteCount;
    /// Sends the buffers `parts` (address, bytes), in order, to rank `peer` as one
    /// group, on the compute stream: after the work issued there so far, and before
    /// what is issued next. The peer receives them with [`DeviceComm::recv`].
    fn send(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError>;
    /// Receives into the buffers `parts`, in order, what rank `peer` sent as one
    /// group, on the compute stream.
    fn recv(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError>;
    /// A communicator of the same ranks for a sibling program on the same compute
    /// stream ([`Driver::sibling`]), with its own stream, events and byte count. A
    /// collective of this communicator: every rank splits, in the same order.
    fn split(&mut self) -> Result<Box<dyn DeviceComm>, CudaError>;
}

fn blas_err(call: &'static str) -> impl Fn(cublas_result::CublasError) -> CudaError {
    move |e| CudaError::Cublas {
        call,
        code: format!("{:?}", e.0),
    }
}

/// cuBLAS workspace, set explicitly so cuBLAS never allocates (a captured graph
/// cannot): NVIDIA's recommendation for Hopper.
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

/// The cuBLAS handle, destroyed on drop.
struct Blas(cublas_sys::cublasHandle_t);

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle came from cublasCreate and is destroyed only here; the
        // context it belongs to outlives it (CudarcDriver declares `blas` before `ctx`).
        #[allow(unsafe_code)]
        let _ = unsafe { cublas_result::destroy_handle(self.0) };
    }
}

/// A pinned buffer, its address taken once (capture must not call
/// `PinnedHostSlice::as_mut_slice`, which synchronizes an event, a call a stream
/// capture in progress may refuse, invalidating it) and its last upload's event.
struct Pinned {
    _buf: PinnedHostSlice<u8>,
    ptr: usize,
    len: usize,
    uploaded: CudaEvent,
}

/// The real driver: one context, one compute stream, cuBLAS on it, through cudarc.
pub struct CudarcDriver {
    // Dropped first: the graph, the handle and every buffer before the stream and
    // context they belong to (fields drop in declaration order).
    graph: Option<CudaGraph>,
    blas: Blas,
    modules: Vec<(Arc<CudaModule>, Vec<CudaFunction>)>,
    buffers: Vec<CudaSlice<u8>>,
    pinned: Vec<Pinned>,
    /// Timing events, reused from one step to the next; the first `marked` are
    /// recorded.
    marks: Vec<CudaEvent>,
    marked: usize,
    _workspace: CudaSlice<u8>,
    name: String,
    tf32: bool,
    arch: String,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl CudarcDriver {
    /// The driver of GPU `ordinal` (the caller probed the libraries and the GPU),
    /// with TF32 tensor-core products when `tf32`.
    pub fn new(ordinal: usize, tf32: bool) -> Result<CudarcDriver, CudaError> {
        let ctx = CudaContext::new(ordinal).map_err(drv_err("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: called before any buffer exists; every buffer is used on the one
        // stream below only (the communicator orders its own stream with events).
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking()
        };
        let stream = ctx.new_stream().map_err(drv_err("cuStreamCreate"))?;
        Self::on_stream(ctx, stream, tf32)
    }

    /// The driver issuing on `stream` of `ctx`, with a cuBLAS handle of its own.
    fn on_stream(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        tf32: bool,
    ) -> Result<CudarcDriver, CudaError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv_err("cuDeviceGetAttribute"))?;
        let name = ctx.name().map_err(drv_err("cuDeviceGetName"))?;
        // cuBLAS on our stream, with its own workspace (no allocation inside a graph).
        let handle = cublas_result::create_handle().map_err(blas_err("cublasCreate"))?;
        let blas = Blas(handle);
        // SAFETY: uninitialised; cuBLAS writes its workspace before reading it.
        #[allow(unsafe_code)]
        let workspace =
            unsafe { stream.alloc::<u8>(CUBLAS_WORKSPACE) }.map_err(drv_err("cuMemAllocAsync"))?;
        let (ws_ptr, _guard) = workspace.device_ptr(&stream);
        let mode = if tf32 {
            cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: the handle is live; the stream and the workspace outlive it (the
        // driver drops `blas` before them); the workspace holds CUBLAS_WORKSPACE bytes.
        #[allow(unsafe_code)]
        unsafe {
            cublas_result::set_stream(blas.0, stream.cu_stream() as _)
                .map_err(blas_err("cublasSetStream"))?;
            cublas_sys::cublasSetWorkspace_v2(blas.0, ws_ptr as *mut _, CUBLAS_WORKSPACE)
                .result()
                .map_err(blas_err("cublasSetWorkspace"))?;
            cublas_sys::cublasSetMathMode(blas.0, mode)
                .result()
                .map_err(blas_err("cublasSetMathMode"))?;
        }
        drop(_guard);
        Ok(CudarcDriver {
            graph: None,
            blas,
            modules: Vec::new(),
            buffers: Vec::new(),
            pinned: Vec::new(),
            marks: Vec::new(),
            marked: 0,
            _workspace: workspace,
            name,
            tf32,
            arch: format!("sm_{major}{minor}"),
            stream,
            ctx,
        })
    }

    fn pinned(&self, b: HostBuf, bytes: usize) -> Result<&Pinned, CudaError> {
        let p = self
            .pinned
            .get(b.0)
            .ok_or_else(|| CudaError::Invalid(format!("no host buffer {}", b.0)))?;
        if bytes > p.len {
            return Err(CudaError::Invalid(format!(
                "{bytes} bytes do not fit the {}-byte host buffer",
                p.len
            )));
        }
        Ok(p)
    }
}

impl Driver for CudarcDriver {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn arch(&self) -> &str {
        &self.arch
    }

    fn uuid(&self) -> Result<[u8; 16], CudaError> {
        let u = self.ctx.uuid().map_err(drv_err("cuDeviceGetUuid"))?;
        let mut out = [0u8; 16];
        for (o, c) in out.iter_mut().zip(u.bytes) {
            *o = c as u8;
        }
        Ok(out)
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))
    }

    fn sibling(&self) -> Result<Box<dyn Driver>, CudaError> {
        self.bind()?;
        Ok(Box::new(Self::on_stream(
            self.ctx.clone(),
            self.stream.clone(),
            self.tf32,
        )?))
    }

    fn load_module(
        &mut self,
        source: &str,
        file: &str,
        names: &[String],
    ) -> Result<Vec<KernelHandle>, CudaError> {
        let cubin = nvrtc::compile_cubin(source, file, &self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(drv_err("cuModuleLoadData"))?;
        let funcs = names
            .iter()
            .map(|n| {
                module.load_function(n).map_err(|e| CudaError::Driver {
                    call: "cuModuleGetFunction",
                    code: format!("{:?} (kernel {n})", e.0),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let m = self.modules.len() as u32;
        self.modules.push((module, funcs));
        Ok((0..names.len() as u32)
            .map(|index| KernelHandle { module: m, index })
            .collect())
    }

    fn launch(&mut self, k: &KernelLaunch<'_>) -> Result<(), CudaError> {
        let f = self
            .modules
            .get(k.kernel.module as usize)
            .and_then(|(_, fs)| fs.get(k.kernel.index as usize))
            .ok_or_else(|| CudaError::Invalid(format!("kernel `{}` not loaded", k.name)))?;
        if k.shared_bytes > 48 * 1024 {
            f.set_attribute(
                drv_sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                k.shared_bytes as i32,
            )
            .map_err(drv_err("cuFuncSetAttribute"))?;
        }
        let cfg = LaunchConfig {
            grid_dim: (k.grid[0], k.grid[1], k.grid[2]),
            block_dim: (k.block[0], k.block[1], k.block[2]),
            shared_mem_bytes: k.shared_bytes,
        };
        let mut b = self.stream.launch_builder(f);
        for v in k.args {
            match v {
                ArgVal::U64(x) => b.arg(x),
                ArgVal::I32(x) => b.arg(x),
                ArgVal::U32(x) => b.arg(x),
                ArgVal::F32(x) => b.arg(x),
            };
        }
        // SAFETY: the backend checked the arguments against the kernel's parameters
        // (in order, each in the C type the codegen doc gives its role); `k.args`
        // outlives the call (the driver copies parameters at launch). Pointers are
        // live buffers of the sizes the plan gave (arena, tensors, slots).
        #[allow(unsafe_code)]
        let r = unsafe { b.launch(cfg) };
        r.map(|_| ()).map_err(|e| CudaError::Driver {
            call: "cuLaunchKernel",
            code: format!("{:?} (kernel {}, {})", e.0, k.name, (k.what)()),
        })
    }

    fn sgemm(&mut self, g: &Gemm, what: &dyn Fn() -> String) -> Result<(), CudaError> {
        let c = &g.call;
        let i = |v: usize| {
            i32::try_from(v)
                .map_err(|_| CudaError::Invalid(format!("{}: {v} exceeds cuBLAS's int", what())))
        };
        let l = |v: usize| {
            i64::try_from(v)
                .map_err(|_| CudaError::Invalid(format!("{}: stride {v} too large", what())))
        };
        let op = |t: bool| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        if c.dtype.is_half() {
            let ty = if c.dtype == DType::BF16 {
                cublas_sys::cudaDataType::CUDA_R_16BF
            } else {
                cublas_sys::cudaDataType::CUDA_R_16F
            };
            // SAFETY: as below; with CUBLAS_COMPUTE_32F, alpha and beta are host f32s,
            // and A, B and C hold 16-bit elements of type `ty`.
            #[allow(unsafe_code)]
            let r = unsafe {
                cublas_result::gemm_strided_batched_ex(
                    self.blas.0,
                    op(c.transa),
                    op(c.transb),
                    i(c.m)?,
                    i(c.n)?,
                    i(c.k)?,
                    (&c.alpha as *const f32).cast(),
                    g.a as *const std::ffi::c_void,
                    ty,
                    i(c.lda)?,
                    l(c.stride_a)?,
                    g.b as *const std::ffi::c_void,
                    ty,
                    i(c.ldb)?,
                    l(c.stride_b)?,
                    (&c.beta as *const f32).cast(),
                    g.c as *mut std::ffi::c_void,
                    ty,
                    i(c.ldc)?,
                    l(c.stride_c)?,
                    i(c.batch)?,
                    // f32 accumulation; the default algorithm uses the tensor cores for
                    // 16-bit inputs.
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            return r.map_err(|e| CudaError::Cublas {
                call: "cublasGemmStridedBatchedEx",
                code: format!("{:?} ({})", e.0, what()),
            });
        }
        // SAFETY: a, b, c are live device buffers holding the matrices the plan's
        // Gemm describes (codegen's row-major mapping); alpha and beta are host
        // scalars (the handle's default pointer mode) read during the call; the
        // handle is bound to our stream.
        #[allow(unsafe_code)]
        let r = unsafe {
            cublas_result::sgemm_strided_batched(
                self.blas.0,
                op(c.transa),
                op(c.transb),
                i(c.m)?,
                i(c.n)?,
                i(c.k)?,
                &c.alpha,
                g.a as *const f32,
                i(c.lda)?,
                l(c.stride_a)?,
                g.b as *const f32,
                i(c.ldb)?,
                l(c.stride_b)?,
                &c.beta,
                g.c as *mut f32,
                i(c.ldc)?,
                l(c.stride_c)?,
                i(c.batch)?,
            )
        };
        r.map_err(|e| CudaError::Cublas {
            call: "cublasSgemmStridedBatched",
            code: format!("{:?} ({})", e.0, what()),
        })
    }

    fn alloc(&mut self, bytes: usize, zeroed: bool) -> Result<u64, CudaError> {
        let bytes = bytes.max(256);
        let buf = if zeroed {
            self.stream.alloc_zeros::<u8>(bytes)
        } else {
            // SAFETY: uninitialised memory; every user writes before reading (arena
            // values are written by the node that computes them, uploads copy in).
            #[allow(unsafe_code)]
            unsafe {
                self.stream.alloc::<u8>(bytes)
            }
        }
        .map_err(drv_err("cuMemAllocAsync"))?;
        let (p, _guard) = buf.device_ptr(&self.stream);
        drop(_guard);
        self.buffers.push(buf);
        Ok(p)
    }

    fn htod(&mut self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: callers pass a live device buffer of at least `src.len()` bytes;
        // `src` is pageable, which the driver stages before returning.
        #[allow(unsafe_code)]
        let r = unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) };
        r.map_err(drv_err("cuMemcpyHtoDAsync"))
    }

    fn read(&mut self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        if !dst.is_empty() {
            // SAFETY: callers pass a live device buffer holding at least `dst.len()`
            // bytes; `dst` is read only after the synchronize below.
            #[allow(unsafe_code)]
            let r = unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) };
            r.map_err(drv_err("cuMemcpyDtoHAsync"))?;
        }
        self.synchronize()
    }

    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `src` and `dst` are live device buffers of at least `bytes` bytes,
        // ordered on the one compute stream.
        #[allow(unsafe_code)]
        let r = unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) };
        r.map_err(drv_err("cuMemcpyDtoDAsync"))
    }

    fn memset_zero(&mut self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is a live buffer of at least `bytes` bytes.
        #[allow(unsafe_code)]
        let r = unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) };
        r.map_err(drv_err("cuMemsetD8Async"))
    }

    fn host_buffer(&mut self, bytes: usize) -> Result<HostBuf, CudaError> {
        // SAFETY: pinned host memory, uninitialised: filled before every upload out
        // of it, or written by a device copy before it is read. Flags 0: not
        // write-combined, since the host reads downloads.
        #[allow(unsafe_code)]
        let mut buf = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
            .map_err(drv_err("cuMemHostAlloc"))?;
        let ptr = buf.as_mut_ptr().map_err(drv_err("cuEventSynchronize"))? as usize;
        let uploaded = self.ctx.new_event(None).map_err(drv_err("cuEventCreate"))?;
        self.pinned.push(Pinned {
            _buf: buf,
            ptr,
            len: bytes,
            uploaded,
        });
        Ok(HostBuf(self.pinned.len() - 1))
    }

    fn host_bytes(&mut self, b: HostBuf) -> Result<&mut [u8], CudaError> {
        let p = self.pinned(b, 0)?;
        // The last upload out of the buffer must be done before it is refilled.
        p.uploaded
            .synchronize()
            .map_err(drv_err("cuEventSynchronize"))?;
        // SAFETY: `ptr` is the pinned buffer's (alive with the driver, `len` bytes);
        // no copy out of it is pending (just waited for) and `&mut self` keeps the
        // driver from issuing one while the slice lives. A download into it is read
        // only after a synchronize, which the caller does.
        #[allow(unsafe_code)]
        Ok(unsafe { std::slice::from_raw_parts_mut(p.ptr as *mut u8, p.len) })
    }

    fn upload(&mut self, b: HostBuf, dst: u64, bytes: usize) -> Result<(), CudaError> {
        let p = self.pinned(b, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the pinned buffer lives as long as the driver and is not refilled
        // before its `uploaded` event (recorded below) has passed; `dst` is a live
        // device buffer of at least `bytes`.
        #[allow(unsafe_code)]
        let r = unsafe {
            let src = std::slice::from_raw_parts(p.ptr as *const u8, bytes);
            drv::memcpy_htod_async(dst, src, self.stream.cu_stream())
        };
        r.map_err(drv_err("cuMemcpyHtoDAsync"))?;
        p.uploaded
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))
    }

    fn download(&mut self, b: HostBuf, src: u64, bytes: usize) -> Result<(), CudaError> {
        let p = self.pinned(b, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the pinned buffer lives as long as the driver; the host reads it
        // through `host_bytes`, which first waits for the event recorded below.
        #[allow(unsafe_code)]
        let r = unsafe {
            let dst = std::slice::from_raw_parts_mut(p.ptr as *mut u8, bytes);
            drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
        };
        r.map_err(drv_err("cuMemcpyDtoHAsync"))?;
        p.uploaded
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))
    }

    fn synchronize(&mut self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(drv_err("cuStreamSynchronize"))
    }

    fn mark(&mut self) -> Result<(), CudaError> {
        if self.marked == self.marks.len() {
            let timed = Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT);
            let e = self
                .ctx
                .new_event(timed)
                .map_err(drv_err("cuEventCreate"))?;
            self.marks.push(e);
        }
        self.marks[self.marked]
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))?;
        self.marked += 1;
        Ok(())
    }

    fn mark_times(&mut self) -> Result<Vec<f64>, CudaError> {
        self.synchronize()?;
        let marked = &self.marks[..std::mem::take(&mut self.marked)];
        let Some(first) = marked.first() else {
            return Ok(Vec::new());
        };
        marked
            .iter()
            .map(|e| {
                first
                    .elapsed_ms(e)
                    .map(|ms| f64::from(ms) * 1e-3)
                    .map_err(drv_err("cuEventElapsedTime"))
            })
            .collect()
    }

    fn begin_capture(&mut self) -> Result<(), CudaError> {
        self.graph = None;
        self.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv_err("cuStreamBeginCapture"))
    }

    fn end_capture(&mut self) -> Result<bool, CudaError> {
        let Some(g) = self
            .stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(drv_err("cuStreamEndCapture / cuGraphInstantiate"))?
        else {
            return Ok(false);
        };
        g.upload().map_err(drv_err("cuGraphUpload"))?;
        self.graph = Some(g);
        Ok(true)
    }

    fn replay(&mut self) -> Result<(), CudaError> {
        let g = self
            .graph
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("no CUDA graph was captured".into()))?;
        g.launch().map_err(drv_err("cuGraphLaunch"))
    }

    fn communicator(
        &mut self,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<Box<dyn DeviceComm>, CudaError> {
        let comm = NcclComm::new(&self.ctx, &self.arch, rank, size, id)?;
        Ok(Box::new(CudarcComm {
            comm,
            compute: self.stream.clone(),
        }))
    }
}

/// NCCL through cudarc, ordered against the driver's compute stream.
struct CudarcComm {
    comm: NcclComm,
    compute: Arc<CudaStream>,
}

impl DeviceComm for CudarcComm {
    fn issue(
        &mut self,
        node: NodeId,
        op: &Op,
        input: u64,
        in_ty: &ValueType,
        output: u64,
        out_ty: &ValueType,
    ) -> Result<(), CudaError> {
        self.comm
            .issue(node, op, &self.compute, input, in_ty, output, out_ty)
    }

    fn order_after(&mut self, node: NodeId) -> Result<(), CudaError> {
        self.comm.order_after(node, &self.compute)
    }

    fn bytes(&self) -> ByteCount {
        self.comm.bytes()
    }

    fn send(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError> {
        self.comm.point_to_point(peer, parts, true, &self.compute)
    }

    fn recv(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError> {
        self.comm.point_to_point(peer, parts, false, &self.compute)
    }

    fn split(&mut self) -> Result<Box<dyn DeviceComm>, CudaError> {
        Ok(Box::new(CudarcComm {
            comm: self.comm.split()?,
            compute: self.compute.clone(),
        }))
    }
}
