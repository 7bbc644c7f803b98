//! The parameter servers' message set and its wire format.
//!
//! Workers send [`Request`]s, servers answer with [`Reply`]s addressed by the
//! requesting worker's rank (the transport's business) and the request's `tag`. Every
//! transport carries the same bytes: in-process channels move the encoded buffers as
//! MPI moves them between processes, so one encoding is tested everywhere.
//!
//! Encoding, little-endian throughout: a one-byte message kind, then the fields in
//! order. Integers are `u64`; strings are a length and UTF-8 bytes; a tensor is a
//! dtype byte (0 f32, 1 f64, 2 i32), a rank, its dimensions, then its elements in
//! row-major order; row ids of sparse values are 8 bytes each, as the metrics count
//! them. A result is a byte (0 ok, 1 error) then the value or the error's text.

use crate::core::value::{Slices, Tensor, Value};
use ndarray::{ArrayD, IxDyn};

/// What a worker asks of a server.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// Rows of the shard `(var, start..end)`: all of them (`ids: None`) or the
    /// shard-local rows `ids`, as of `step`.
    Pull {
        /// Echoed in the reply.
        tag: u64,
        /// The variable.
        var: String,
        /// The shard's first row.
        start: usize,
        /// One past its last row.
        end: usize,
        /// Shard-local row ids, or every row.
        ids: Option<Vec<usize>>,
        /// The worker's step.
        step: u64,
    },
    /// The worker's gradient of the shard `(var, start..end)` for `step`: dense of the
    /// shard's shape, or slices with shard-local row ids.
    Push {
        /// The variable.
        var: String,
        /// The shard's first row.
        start: usize,
        /// One past its last row.
        end: usize,
        /// The worker's step.
        step: u64,
        /// The gradient.
        grad: Value,
    },
    /// The worker has finished. Once every worker has, the server applies what is
    /// pending and stops; a worker that set `collect` gets the server's shards back
    /// (for `--save`).
    Shutdown {
        /// Echoed in the reply.
        tag: u64,
        /// Whether to send the shards' values back.
        collect: bool,
    },
    /// Every shard's rows and optimizer slots once `step` is applied (for a training
    /// state on disk), answered with [`Reply::Shards`]: a shard's rows under its
    /// variable's name, a slot's rows under `VAR/SLOT`.
    Snapshot {
        /// Echoed in the reply.
        tag: u64,
        /// The step whose update the snapshot follows.
        step: u64,
    },
    /// The worker failed: the server answers every waiting and later request with
    /// this reason, so no other worker waits for a step that will not come.
    Abort {
        /// What failed.
        reason: String,
    },
}

/// A server's answer, to the worker whose request it was.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// The rows a pull asked for, or why not.
    Rows {
        /// The pull's tag.
        tag: u64,
        /// The rows.
        result: Result<Tensor, String>,
    },
    /// The server has failed (a push it could not apply, a worker that aborted): it
    /// answers every request with this from now on.
    Failed {
        /// The request's tag.
        tag: u64,
        /// Why.
        error: String,
    },
    /// Every shard the server holds, `(var, start, rows)`, after the last step.
    Shards {
        /// The shutdown's tag.
        tag: u64,
        /// The shards.
        result: Result<Vec<(String, usize, Tensor)>, String>,
    },
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn usize(&mut self, x: usize) {
        self.u64(x as u64);
    }
    fn str(&mut self, s: &str) {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn tensor(&mut self, t: &Tensor) {
        let (code, dims) = match t {
            Tensor::F32(a) => (0u8, a.shape()),
            Tensor::F64(a) => (1, a.shape()),
            Tensor::I32(a) => (2, a.shape()),
            Tensor::BF16(a) => (3, a.shape()),
            Tensor::F16(a) => (4, a.shape()),
        };
        self.u8(code);
        self.usize(dims.len());
        for &d in dims {
            self.usize(d);
        }
        match t {
            Tensor::F32(a) => {
                self.0.reserve(a.len() * 4);
                a.iter()
                    .for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
            }
            Tensor::F64(a) => {
                self.0.reserve(a.len() * 8);
                a.iter()
                    .for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
            }
            Tensor::I32(a) => {
                self.0.reserve(a.len() * 4);
                a.iter()
                    .for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
            }
            Tensor::BF16(a) => {
                self.0.reserve(a.len() * 2);
                a.iter()
                    .for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
            }
            Tensor::F16(a) => {
                self.0.reserve(a.len() * 2);
                a.iter()
                    .for_each(|x| self.0.extend_from_slice(&x.to_le_bytes()));
            }
        }
    }
    fn value(&mut self, v: &Value) {
        match v {
            Value::Tensor(t) => {
                self.u8(0);
                self.tensor(t);
            }
            Value::Slices(s) => {
                self.u8(1);
                self.usize(s.indices.len());
                for &i in &s.indices {
                    self.0.extend_from_slice(&i64::from(i).to_le_bytes());
                }
                self.tensor(&s.values);
                self.usize(s.dense_shape.len());
                for &d in &s.dense_shape {
                    self.usize(d);
                }
            }
        }
    }
    fn result<T>(&mut self, r: &Result<T, String>, ok: impl FnOnce(&mut Writer, &T)) {
        match r {
            Ok(v) => {
                self.u8(0);
                ok(self, v);
            }
            Err(e) => {
                self.u8(1);
                self.str(e);
            }
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

type Decoded<T> = Result<T, String>;

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Decoded<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "message truncated: {n} bytes wanted at offset {} of {}",
                    self.at,
                    self.buf.len()
                )
            })?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Decoded<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn u64(&mut self) -> Decoded<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn usize(&mut self) -> Decoded<usize> {
        usize::try_from(self.u64()?).map_err(|e| e.to_string())
    }
    /// A count of items of `size` bytes each that must fit in what is left.
    fn count(&mut self, size: usize) -> Decoded<usize> {
        let n = self.usize()?;
        if n.saturating_mul(size.max(1)) > self.buf.len() - self.at {
            return Err(format!("message truncated: {n} items announced"));
        }
        Ok(n)
    }
    fn str(&mut self) -> Decoded<String> {
        let n = self.count(1)?;
        String::from_utf8(self.bytes(n)?.to_vec()).map_err(|e| e.to_string())
    }
    fn dims(&mut self) -> Decoded<Vec<usize>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.usize()).collect()
    }
    fn tensor(&mut self) -> Decoded<Tensor> {
        let code = self.u8()?;
        let dims = self.dims()?;
        let n = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or("tensor size overflows")?;
        let size = match code {
            1 => 8,
            3 | 4 => 2,
            _ => 4,
        };
        let raw = self.bytes(n.checked_mul(size).ok_or("tensor size overflows")?)?;
        let shape = IxDyn(&dims);
        let bad = |e: ndarray::ShapeError| e.to_string();
        Ok(match code {
            0 => Tensor::F32(
                ArrayD::from_shape_vec(
                    shape,
                    raw.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            1 => Tensor::F64(
                ArrayD::from_shape_vec(
                    shape,
                    raw.chunks_exact(8)
                        .map(|c| {
                            let mut b = [0u8; 8];
                            b.copy_from_slice(c);
                            f64::from_le_bytes(b)
                        })
                        .collect(),
                )
                .map_err(bad)?,
            ),
            2 => Tensor::I32(
                ArrayD::from_shape_vec(
                    shape,
                    raw.chunks_exact(4)
                        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            3 => Tensor::BF16(
                ArrayD::from_shape_vec(
                    shape,
                    raw.chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            4 => Tensor::F16(
                ArrayD::from_shape_vec(
                    shape,
                    raw.chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            c => return Err(format!("unknown dtype code {c}")),
        })
    }
    fn value(&mut self) -> Decoded<Value> {
        match self.u8()? {
            0 => Ok(Value::Tensor(self.tensor()?)),
            1 => {
                let n = self.count(8)?;
                let indices = (0..n)
                    .map(|_| {
                        let id = self.u64()? as i64;
                        i32::try_from(id).map_err(|_| format!("row id {id} out of range"))
                    })
                    .collect::<Decoded<Vec<i32>>>()?;
                let values = self.tensor()?;
                let dense_shape = self.dims()?;
                Ok(Value::Slices(Slices {
                    indices,
                    values,
                    dense_shape,
                }))
            }
            k => Err(format!("unknown value kind {k}")),
        }
    }
    fn result<T>(
        &mut self,
        ok: impl FnOnce(&mut Self) -> Decoded<T>,
    ) -> Decoded<Result<T, String>> {
        match self.u8()? {
            0 => Ok(Ok(ok(self)?)),
            1 => Ok(Err(self.str()?)),
            k => Err(format!("unknown result kind {k}")),
        }
    }
    fn end(&self) -> Decoded<()> {
        if self.at == self.buf.len() {
            Ok(())
        } else {
            Err(format!(
                "{} bytes left over after the message",
                self.buf.len() - self.at
            ))
        }
    }
}

const PULL: u8 = 1;
const PUSH: u8 = 2;
const SHUTDOWN: u8 = 3;
const ABORT: u8 = 4;
const SNAPSHOT: u8 = 5;
const ROWS: u8 = 10;
const SHARDS: u8 = 11;
const FAILED: u8 = 12;

impl Request {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        match self {
            Request::Pull {
                tag,
                var,
                start,
                end,
                ids,
                step,
            } => {
                w.u8(PULL);
                w.u64(*tag);
                w.str(var);
                w.usize(*start);
                w.usize(*end);
                w.u64(*step);
                match ids {
                    None => w.u8(0),
                    Some(ids) => {
                        w.u8(1);
                        w.usize(ids.len());
                        ids.iter().for_each(|&i| w.usize(i));
                    }
                }
            }
            Request::Push {
                var,
                start,
                end,
                step,
                grad,
            } => {
                w.u8(PUSH);
                w.str(var);
                w.usize(*start);
                w.usize(*end);
                w.u64(*step);
                w.value(grad);
            }
            Request::Shutdown { tag, collect } => {
                w.u8(SHUTDOWN);
                w.u64(*tag);
                w.u8(u8::from(*collect));
            }
            Request::Abort { reason } => {
                w.u8(ABORT);
                w.str(reason);
            }
            Request::Snapshot { tag, step } => {
                w.u8(SNAPSHOT);
                w.u64(*tag);
                w.u64(*step);
            }
        }
        w.0
    }

    /// Decodes a message, or says what is wrong with it.
    pub fn decode(buf: &[u8]) -> Result<Request, String> {
        let mut r = Reader { buf, at: 0 };
        let req = match r.u8()? {
            PULL => {
                let tag = r.u64()?;
                let var = r.str()?;
                let (start, end, step) = (r.usize()?, r.usize()?, r.u64()?);
                let ids = match r.u8()? {
                    0 => None,
                    _ => {
                        let n = r.count(8)?;
                        Some((0..n).map(|_| r.usize()).collect::<Decoded<_>>()?)
                    }
                };
                Request::Pull {
                    tag,
                    var,
                    start,
                    end,
                    ids,
                    step,
                }
            }
            PUSH => Request::Push {
                var: r.str()?,
                start: r.usize()?,
                end: r.usize()?,
                step: r.u64()?,
                grad: r.value()?,
            },
            SHUTDOWN => Request::Shutdown {
                tag: r.u64()?,
                collect: r.u8()? != 0,
            },
            ABORT => Request::Abort { reason: r.str()? },
            SNAPSHOT => Request::Snapshot {
                tag: r.u64()?,
                step: r.u64()?,
            },
            k => return Err(format!("unknown request kind {k}")),
        };
        r.end()?;
        Ok(req)
    }
}

impl Reply {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        match self {
            Reply::Rows { tag, result } => {
                w.u8(ROWS);
                w.u64(*tag);
                w.result(result, |w, t| w.tensor(t));
            }
            Reply::Failed { tag, error } => {
                w.u8(FAILED);
                w.u64(*tag);
                w.str(error);
            }
            Reply::Shards { tag, result } => {
                w.u8(SHARDS);
                w.u64(*tag);
                w.result(result, |w, shards| {
                    w.usize(shards.len());
                    for (var, start, t) in shards {
                        w.str(var);
                        w.usize(*start);
                        w.tensor(t);
                    }
                });
            }
        }
        w.0
    }

    /// Decodes a message, or says what is wrong with it.
    pub fn decode(buf: &[u8]) -> Result<Reply, String> {
        let mut r = Reader { buf, at: 0 };
        let reply = match r.u8()? {
            ROWS => Reply::Rows {
                tag: r.u64()?,
                result: r.result(|r| r.tensor())?,
            },
            FAILED => Reply::Failed {
                tag: r.u64()?,
                error: r.str()?,
            },
            SHARDS => Reply::Shards {
                tag: r.u64()?,
                result: r.result(|r| {
                    let n = r.count(1)?;
                    (0..n)
                        .map(|_| Ok((r.str()?, r.usize()?, r.tensor()?)))
                        .collect()
                })?,
            },
            k => return Err(format!("unknown reply kind {k}")),
        };
        r.end()?;
        Ok(reply)
    }

    /// The tag of the request this answers.
    pub fn tag(&self) -> u64 {
        match self {
            Reply::Rows { tag, .. } | Reply::Failed { tag, .. } | Reply::Shards { tag, .. } => *tag,
        }
    }
}

/// Named values as one message: a pipeline stage's sends of one micro-batch to one
/// stage.
pub fn encode_values(values: &[(String, Value)]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.usize(values.len());
    for (name, v) in values {
        w.str(name);
        w.value(v);
    }
    w.0
}

/// The values of [`encode_values`]; a truncated or malformed message is an error.
pub fn decode_values(buf: &[u8]) -> Result<Vec<(String, Value)>, String> {
    let mut r = Reader { buf, at: 0 };
    let n = r.count(9)?;
    let values = (0..n)
        .map(|_| Ok((r.str()?, r.value()?)))
        .collect::<Decoded<Vec<_>>>()?;
    r.end()?;
    Ok(values)
}
