//! [`EmuDriver`]: the CUDA backend's [`Driver`] on the CPU (issue 21). The backend's
//! own requests (allocations, copies, launches with their geometry and packed
//! arguments, cuBLAS products, pinned buffers, graph capture and replay) run on an
//! [`EmuDevice`], whose checks turn what a GPU punishes only sometimes into a named
//! error: a race between streams, memory allocated during a capture, a read of bytes
//! never written, a copy or a kernel write outside its buffer.
//!
//! Kernels are the generated CUDA C compiled by the system C++ compiler
//! ([`EmuModule`]). Each pointer argument reaches the kernel as a guarded copy of the
//! bytes the backend says it may touch ([`Region`]), so a write past a value, even
//! inside the arena, is caught, and a read past it gives NaN.
//!
//! What it cannot show: speed, the hardware's and driver's own behaviour, memory
//! ordering between blocks running at once, and NCCL (not emulated yet: a run that
//! needs it is refused by name).

use super::blas::{gemm_ex_16, sgemm_strided_batched};
use super::device::{EmuDevice, EmuFault, Event, Stream, Touch};
use super::nccl::{CommCore, EmuComm};
use super::EmuModule;
use crate::cuda::driver::{
    Access, ArgVal, DeviceComm, Driver, Gemm, HostBuf, KernelHandle, KernelLaunch, Region,
};
use crate::cuda::CudaError;
use distc_ir::{NodeId, Op, ValueType};
use std::cell::RefCell;
use std::ffi::c_void;
use std::rc::Rc;

impl From<EmuFault> for CudaError {
    fn from(e: EmuFault) -> CudaError {
        CudaError::Invalid(format!("GPU emulator: {e}"))
    }
}

impl From<super::EmuError> for CudaError {
    fn from(e: super::EmuError) -> CudaError {
        CudaError::Invalid(format!("GPU emulator: {e}"))
    }
}

/// One operation recorded while the compute stream was captured.
pub(super) enum Recorded {
    Launch {
        kernel: KernelHandle,
        name: String,
        grid: [u32; 3],
        block: [u32; 3],
        args: Vec<ArgVal>,
        regions: Vec<Region>,
        what: String,
    },
    Gemm(Gemm, String),
    Memset(u64, usize),
    Fresh(u64, usize),
    Download(HostBuf, u64, usize),
    /// A device-to-device copy: target, source, bytes.
    Copy(u64, u64, usize),
    /// An event recorded on a stream, or a stream waiting on one.
    Record(Stream, Event),
    Wait(Stream, Event),
    /// A collective on the emulated communicator.
    Collective {
        comm: Rc<RefCell<CommCore>>,
        node: NodeId,
        op: Op,
        input: u64,
        in_ty: ValueType,
        output: u64,
        out_ty: ValueType,
    },
    /// A send or a receive of buffers (address, bytes) with a peer of the communicator.
    Message {
        comm: Rc<RefCell<CommCore>>,
        peer: usize,
        parts: Vec<(u64, usize)>,
        send: bool,
    },
}

/// A module and its kernels' names, in the order of their handles' indices.
struct LoadedModule(EmuModule, Vec<String>);

/// What the driver and its communicator share: the device and the capture.
pub(super) struct Shared {
    pub(super) dev: EmuDevice,
    pub(super) capture: Option<Vec<Recorded>>,
}

/// The emulated GPU (see the module doc).
pub struct EmuDriver {
    shared: Rc<RefCell<Shared>>,
    compute: Stream,
    /// Every module loaded on this device, by its siblings too: a graph one of them
    /// captures holds the others' launches on the shared stream.
    modules: Rc<RefCell<Vec<Rc<LoadedModule>>>>,
    host: Vec<Vec<u8>>,
    graph: Option<Vec<Recorded>>,
    name: String,
    /// Time marks: the host's clock, since every launch runs when it is issued.
    marks: Vec<std::time::Instant>,
}

impl EmuDriver {
    /// Emulated GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<EmuDriver, CudaError> {
        Ok(EmuDriver {
            shared: Rc::new(RefCell::new(Shared {
                dev: EmuDevice::new(),
                capture: None,
            })),
            compute: Stream(0),
            modules: Rc::default(),
            host: Vec::new(),
            graph: None,
            name: format!("GPU emulator {ordinal}, on the CPU"),
            marks: Vec::new(),
        })
    }

    fn capturing(&self) -> bool {
        self.shared.borrow().capture.is_some()
    }

    fn dev(&self) -> std::cell::RefMut<'_, EmuDevice> {
        std::cell::RefMut::map(self.shared.borrow_mut(), |s| &mut s.dev)
    }

    fn no_capture(&self, what: &str) -> Result<(), CudaError> {
        if self.capturing() {
            return Err(CudaError::Invalid(format!(
                "GPU emulator: {what} while the compute stream is being captured (a CUDA \
                 graph cannot hold it)"
            )));
        }
        Ok(())
    }

    fn host_buf(&mut self, b: HostBuf, bytes: usize) -> Result<&mut Vec<u8>, CudaError> {
        let buf = self
            .host
            .get_mut(b.0)
            .ok_or_else(|| CudaError::Invalid(format!("no host buffer {}", b.0)))?;
        if bytes > buf.len() {
            return Err(CudaError::Invalid(format!(
                "{bytes} bytes do not fit the {}-byte host buffer",
                buf.len()
            )));
        }
        Ok(buf)
    }

    fn run_launch(&mut self, k: &KernelLaunch<'_>) -> Result<(), CudaError> {
        let loaded = self
            .modules
            .borrow()
            .get(k.kernel.module as usize)
            .cloned()
            .ok_or_else(|| CudaError::Invalid(format!("kernel `{}` not loaded", k.name)))?;
        let LoadedModule(module, names) = &*loaded;
        let name = names
            .get(k.kernel.index as usize)
            .ok_or_else(|| CudaError::Invalid(format!("kernel `{}` not loaded", k.name)))?;
        if name != k.name {
            return Err(CudaError::Invalid(format!(
                "the handle of kernel `{}` names `{name}`",
                k.name
            )));
        }
        if k.shared_bytes > 0 {
            return Err(CudaError::Invalid(format!(
                "GPU emulator: kernel `{}` asks for {} bytes of dynamic shared memory, \
                 which the emulator does not provide",
                k.name, k.shared_bytes
            )));
        }
        let mut touches = Vec::with_capacity(k.regions.len());
        for r in k.regions {
            let Some(ArgVal::U64(addr)) = k.args.get(r.arg) else {
                return Err(CudaError::Invalid(format!(
                    "{}: argument {} of kernel `{}` has a region but is not a pointer",
                    (k.what)(),
                    r.arg,
                    k.name
                )));
            };
            touches.push(Touch {
                addr: *addr,
                len: r.bytes,
                must_be_written: match r.access {
                    Access::Read | Access::ReadWrite => r.bytes,
                    Access::ReadCounted | Access::ReadWriteCounted | Access::Append => 4,
                    Access::Write => 0,
                },
                write: matches!(
                    r.access,
                    Access::Write | Access::ReadWrite | Access::ReadWriteCounted | Access::Append
                ),
            });
        }
        let what = format!("kernel `{}` ({})", k.name, (k.what)());
        let (grid, block) = (k.grid, k.block);
        let mut err = None;
        let compute = self.compute;
        self.shared
            .borrow_mut()
            .dev
            .run(compute, &what, &touches, |ptrs| {
                // Each argument as cuLaunchKernel takes it: a pointer to its value; a
                // buffer's value is the host address of its guarded copy.
                let mut vals: Vec<u64> = k
                    .args
                    .iter()
                    .map(|a| match *a {
                        ArgVal::U64(x) => x,
                        ArgVal::I32(x) => u64::from(x as u32),
                        ArgVal::U32(x) => u64::from(x),
                        ArgVal::F32(x) => u64::from(x.to_bits()),
                    })
                    .collect();
                for (r, p) in k.regions.iter().zip(ptrs.iter()) {
                    vals[r.arg] = *p as u64;
                }
                let mut argp: Vec<*mut c_void> = vals
                    .iter_mut()
                    .map(|v| (v as *mut u64).cast::<c_void>())
                    .collect();
                // SAFETY: the backend checked every value against the kernel's parameter
                // classes; 4-byte values sit in the low bytes of their u64 (little-endian
                // x86-64 and aarch64), where the launcher reads them; every pointer is a
                // guarded copy of the bytes the backend says the kernel may touch.
                #[allow(unsafe_code)]
                let r = unsafe { module.launch(name, grid, block, &mut argp) };
                r.map_err(|e| {
                    let m = e.to_string();
                    err = Some(e);
                    m
                })
            })?;
        match err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    fn run_gemm(&mut self, g: &Gemm, what: &str) -> Result<(), CudaError> {
        let c = &g.call;
        let touches = [
            Touch {
                addr: g.a,
                len: g.bytes[0],
                must_be_written: g.bytes[0],
                write: false,
            },
            Touch {
                addr: g.b,
                len: g.bytes[1],
                must_be_written: g.bytes[1],
                write: false,
            },
            Touch {
                addr: g.c,
                len: g.bytes[2],
                must_be_written: if c.beta == 0.0 { 0 } else { g.bytes[2] },
                write: true,
            },
        ];
        if c.dtype.is_half() {
            let what = format!("cublasGemmStridedBatchedEx ({what})");
            self.dev().run(self.compute, &what, &touches, |p| {
                let f = |k: usize| g.bytes[k] / 2;
                // SAFETY: each pointer is an 8-aligned guarded copy of `g.bytes[k]` bytes.
                #[allow(unsafe_code)]
                let (a, b, cc) = unsafe {
                    (
                        std::slice::from_raw_parts(p[0].cast::<u16>(), f(0)),
                        std::slice::from_raw_parts(p[1].cast::<u16>(), f(1)),
                        std::slice::from_raw_parts_mut(p[2].cast::<u16>(), f(2)),
                    )
                };
                gemm_ex_16(c, a, b, cc)
            })?;
            return Ok(());
        }
        let what = format!("cublasSgemmStridedBatched ({what})");
        self.dev().run(self.compute, &what, &touches, |p| {
            let f = |k: usize| g.bytes[k] / 4;
            // SAFETY: each pointer is an 8-aligned guarded copy of `g.bytes[k]` bytes.
            #[allow(unsafe_code)]
            let (a, b, cc) = unsafe {
                (
                    std::slice::from_raw_parts(p[0].cast::<f32>(), f(0)),
                    std::slice::from_raw_parts(p[1].cast::<f32>(), f(1)),
                    std::slice::from_raw_parts_mut(p[2].cast::<f32>(), f(2)),
                )
            };
            sgemm_strided_batched(c, a, b, cc)
        })?;
        Ok(())
    }

    fn run_memset(&mut self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let (p, off) = self.dev().locate(dst, bytes, "a memset")?;
        self.dev().memset(self.compute, p, off, 0, bytes)?;
        Ok(())
    }

    fn run_download(&mut self, b: HostBuf, src: u64, bytes: usize) -> Result<(), CudaError> {
        let (p, off) = self.dev().locate(src, bytes, "a device-to-host copy")?;
        let mut tmp = vec![0u8; bytes];
        self.dev().copy_dtoh(self.compute, p, off, &mut tmp)?;
        self.host_buf(b, bytes)?[..bytes].copy_from_slice(&tmp);
        Ok(())
    }

    fn run_copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        let mut tmp = vec![0u8; bytes];
        let (p, off) = self
            .dev()
            .locate(src, bytes, "a device-to-device copy's source")?;
        self.dev().copy_dtoh(self.compute, p, off, &mut tmp)?;
        let (q, off) = self
            .dev()
            .locate(dst, bytes, "a device-to-device copy's target")?;
        self.dev().copy_htod(self.compute, q, off, &tmp)?;
        Ok(())
    }

    fn replay_one(&mut self, r: &Recorded) -> Result<(), CudaError> {
        match r {
            Recorded::Launch {
                kernel,
                name,
                grid,
                block,
                args,
                regions,
                what,
            } => self.run_launch(&KernelLaunch {
                kernel: *kernel,
                name,
                grid: *grid,
                block: *block,
                shared_bytes: 0,
                args,
                regions,
                what: &|| what.clone(),
            }),
            Recorded::Gemm(g, what) => self.run_gemm(g, what),
            Recorded::Memset(dst, bytes) => self.run_memset(*dst, *bytes),
            Recorded::Fresh(dst, bytes) => Ok(self.dev().fresh(*dst, *bytes)?),
            Recorded::Download(b, src, bytes) => self.run_download(*b, *src, *bytes),
            Recorded::Copy(dst, src, bytes) => self.run_copy(*dst, *src, *bytes),
            Recorded::Record(s, e) => Ok(self.dev().record_event(*s, *e)?),
            Recorded::Wait(s, e) => Ok(self.dev().wait_event(*s, *e)?),
            Recorded::Collective {
                comm,
                node,
                op,
                input,
                in_ty,
                output,
                out_ty,
            } => comm.borrow_mut().run(
                &mut self.shared.borrow_mut().dev,
                *node,
                op,
                (*input, in_ty),
                (*output, out_ty),
            ),
            Recorded::Message {
                comm,
                peer,
                parts,
                send,
            } => comm
                .borrow_mut()
                .message(&mut self.shared.borrow_mut().dev, *peer, parts, *send),
        }
    }

    fn record(&mut self, r: Recorded) {
        if let Some(c) = &mut self.shared.borrow_mut().capture {
            c.push(r);
        }
    }
}

impl Driver for EmuDriver {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn arch(&self) -> &str {
        "emulated"
    }

    fn uuid(&self) -> Result<[u8; 16], CudaError> {
        // One emulated device per process and ordinal is all a rank can tell apart.
        let mut u = [0u8; 16];
        u[..4].copy_from_slice(&std::process::id().to_ne_bytes());
        Ok(u)
    }

    fn bind(&self) -> Result<(), CudaError> {
        Ok(())
    }

    fn sibling(&self) -> Result<Box<dyn Driver>, CudaError> {
        Ok(Box::new(EmuDriver {
            shared: self.shared.clone(),
            compute: self.compute,
            modules: self.modules.clone(),
            host: Vec::new(),
            graph: None,
            name: self.name.clone(),
            marks: Vec::new(),
        }))
    }

    fn checks_accesses(&self) -> bool {
        true
    }

    fn load_module(
        &mut self,
        source: &str,
        _file: &str,
        names: &[String],
    ) -> Result<Vec<KernelHandle>, CudaError> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let module = EmuModule::compile(source, &refs)?;
        let mut modules = self.modules.borrow_mut();
        let m = modules.len() as u32;
        modules.push(Rc::new(LoadedModule(module, names.to_vec())));
        Ok((0..names.len() as u32)
            .map(|index| KernelHandle { module: m, index })
            .collect())
    }

    fn launch(&mut self, k: &KernelLaunch<'_>) -> Result<(), CudaError> {
        if self.capturing() {
            // Checked now (bounds, ordering), run at each replay.
            self.record(Recorded::Launch {
                kernel: k.kernel,
                name: k.name.to_string(),
                grid: k.grid,
                block: k.block,
                args: k.args.to_vec(),
                regions: k.regions.to_vec(),
                what: (k.what)(),
            });
        }
        self.run_launch(k)
    }

    fn sgemm(&mut self, g: &Gemm, what: &dyn Fn() -> String) -> Result<(), CudaError> {
        let what = what();
        self.record(Recorded::Gemm(*g, what.clone()));
        self.run_gemm(g, &what)
    }

    fn alloc(&mut self, bytes: usize, zeroed: bool) -> Result<u64, CudaError> {
        let bytes = bytes.max(256);
        let p = self.dev().alloc(bytes)?;
        if zeroed {
            self.dev().memset(self.compute, p, 0, 0, bytes)?;
        }
        Ok(p.0)
    }

    fn htod(&mut self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        self.no_capture("a copy from pageable host memory")?;
        let (p, off) = self.dev().locate(dst, src.len(), "a host-to-device copy")?;
        self.dev().copy_htod(self.compute, p, off, src)?;
        Ok(())
    }

    fn read(&mut self, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.no_capture("a synchronous copy to the host")?;
        if dst.is_empty() {
            return Ok(());
        }
        let (p, off) = self.dev().locate(src, dst.len(), "a device-to-host copy")?;
        self.dev().copy_dtoh(self.compute, p, off, dst)?;
        Ok(())
    }

    fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        if self.capturing() {
            self.dev()
                .locate(src, bytes, "a device-to-device copy's source")?;
            self.dev()
                .locate(dst, bytes, "a device-to-device copy's target")?;
            self.record(Recorded::Copy(dst, src, bytes));
            return Ok(());
        }
        self.run_copy(dst, src, bytes)
    }

    fn memset_zero(&mut self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        self.record(Recorded::Memset(dst, bytes));
        self.run_memset(dst, bytes)
    }

    fn fresh(&mut self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        self.record(Recorded::Fresh(dst, bytes));
        if self.capturing() {
            return Ok(());
        }
        Ok(self.dev().fresh(dst, bytes)?)
    }

    fn host_buffer(&mut self, bytes: usize) -> Result<HostBuf, CudaError> {
        self.no_capture("allocating pinned host memory")?;
        self.host.push(vec![0; bytes.max(1)]);
        Ok(HostBuf(self.host.len() - 1))
    }

    fn host_bytes(&mut self, b: HostBuf) -> Result<&mut [u8], CudaError> {
        Ok(self.host_buf(b, 0)?.as_mut_slice())
    }

    fn upload(&mut self, b: HostBuf, dst: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        self.no_capture("an upload")?;
        let src = self.host_buf(b, bytes)?[..bytes].to_vec();
        let (p, off) = self.dev().locate(dst, bytes, "a host-to-device copy")?;
        self.dev().copy_htod(self.compute, p, off, &src)?;
        Ok(())
    }

    fn download(&mut self, b: HostBuf, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        if self.capturing() {
            self.dev().locate(src, bytes, "a device-to-host copy")?;
            self.record(Recorded::Download(b, src, bytes));
            return Ok(());
        }
        self.run_download(b, src, bytes)
    }

    fn synchronize(&mut self) -> Result<(), CudaError> {
        // Everything ran when it was issued.
        self.no_capture("synchronizing")
    }

    fn mark(&mut self) -> Result<(), CudaError> {
        self.no_capture("recording a time mark")?;
        self.marks.push(std::time::Instant::now());
        Ok(())
    }

    fn mark_times(&mut self) -> Result<Vec<f64>, CudaError> {
        self.no_capture("reading time marks")?;
        let marks = std::mem::take(&mut self.marks);
        Ok(marks
            .iter()
            .map(|m| m.duration_since(marks[0]).as_secs_f64())
            .collect())
    }

    fn begin_capture(&mut self) -> Result<(), CudaError> {
        let compute = self.compute;
        self.dev().begin_capture(compute)?;
        self.shared.borrow_mut().capture = Some(Vec::new());
        self.graph = None;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<bool, CudaError> {
        let compute = self.compute;
        self.dev().end_capture(compute)?;
        let ops = self.shared.borrow_mut().capture.take().unwrap_or_default();
        let any = !ops.is_empty();
        self.graph = any.then_some(ops);
        Ok(any)
    }

    fn replay(&mut self) -> Result<(), CudaError> {
        let ops = self
            .graph
            .take()
            .ok_or_else(|| CudaError::Invalid("no CUDA graph was captured".into()))?;
        let r = ops.iter().try_for_each(|op| self.replay_one(op));
        self.graph = Some(ops);
        r
    }

    fn communicator(
        &mut self,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<Box<dyn DeviceComm>, CudaError> {
        let stream = self.dev().stream();
        Ok(Box::new(EmuComm::join(
            self.shared.clone(),
            self.compute,
            stream,
            rank,
            size,
            id,
        )?))
    }
}
