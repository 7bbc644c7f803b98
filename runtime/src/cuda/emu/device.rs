//! The emulator's device memory, streams, events and graph capture: what the driver
//! does with them, and the checks a real GPU only punishes sometimes.
//!
//! Device memory is host memory, one allocation per `alloc`, addressed by the handle
//! the emulator returns. For each allocation it records which bytes were ever written
//! and which stream last wrote it with which work; an event records a stream's
//! position, and a stream that waits on it may then touch what came before. The checks:
//!
//! * **race**: a stream touches an allocation that another stream wrote, with no event
//!   recorded after that write and waited on by this stream;
//! * **capture**: memory allocated or freed while a stream is being captured (a graph
//!   replays addresses: they must exist before capture and outlive the graph);
//! * **uninitialised read**: a copy to the host, or a launch that reads, touches bytes
//!   never written;
//! * **bounds**: a copy, a memset or a declared access outside its allocation.
//!
//! Launches declare what they read and write (the CUDA backend knows it from each
//! launch's inputs and outputs); the kernel itself runs through [`super::EmuModule`].
//! Operations run in order per stream, at once: the emulator has one timeline, so an
//! ordering bug shows up as a check firing, not as a wrong number.

use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// A `u64` buffer's bytes.
fn bytes_of_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: a u64 slice is plain bytes, 8 per element; u8 has alignment 1.
    #[allow(unsafe_code)]
    unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * 8)
    }
}

/// What never-written device memory holds, word by word: a NaN as an f32 (so a value
/// read past its end or before it was written spoils the result) and an unlikely
/// `int`. A word a kernel leaves holding it counts as not written.
pub const POISON: [u8; 4] = 0x7FBA_DBADu32.to_ne_bytes();

/// Bytes of poison on each side of a buffer a kernel gets: a write there is out of
/// bounds.
const GUARD: usize = 64;

/// What a launch may do with one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Touch {
    /// The device address.
    pub addr: u64,
    /// Bytes from it.
    pub len: usize,
    /// Bytes from the start that must have been written before (0: none).
    pub must_be_written: usize,
    /// Whether the launch writes it.
    pub write: bool,
}

/// A device allocation, as the emulator hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevPtr(pub u64);

/// A stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub u32);

/// An event: a stream's position when it was recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u32);

/// What a check found.
#[derive(Debug, Error, PartialEq)]
pub enum EmuFault {
    /// Two streams touch one allocation with no event between them.
    #[error(
        "race on allocation {ptr:?}: stream {now:?} {what} it after stream {writer:?} wrote \
         it (operation {op}) with no event recorded after that write and waited on by stream \
         {now:?}"
    )]
    Race {
        /// The allocation.
        ptr: DevPtr,
        /// The stream that wrote it last.
        writer: Stream,
        /// That stream's operation number.
        op: u64,
        /// The stream touching it now.
        now: Stream,
        /// `reads` or `writes`.
        what: &'static str,
    },
    /// Memory allocated or freed during a capture.
    #[error("{0} while stream {1:?} is being captured: a graph replays addresses, so memory must be allocated before capture and freed after the graph")]
    DuringCapture(&'static str, Stream),
    /// Bytes read that were never written.
    #[error("{what} reads bytes {start}..{end} of allocation {ptr:?}, never written")]
    Uninitialised {
        /// The allocation.
        ptr: DevPtr,
        /// First byte never written.
        start: usize,
        /// One past the last byte read.
        end: usize,
        /// What read them.
        what: String,
    },
    /// An access outside its allocation (or to no allocation).
    #[error("{what} touches bytes {start}..{end} of allocation {ptr:?}, which holds {size}")]
    OutOfBounds {
        /// The allocation.
        ptr: DevPtr,
        /// First byte touched.
        start: usize,
        /// One past the last.
        end: usize,
        /// The allocation's size (0: no such allocation).
        size: usize,
        /// What touched them.
        what: String,
    },
    /// An unknown stream, event or allocation, or a capture misuse.
    #[error("{0}")]
    Misuse(String),
}

struct Allocation {
    bytes: Vec<u8>,
    written: Vec<bool>,
    /// Per 4-byte word, the stream that wrote it last and that stream's operation
    /// number then: streams may write different parts of one allocation at once (a
    /// collective's result and a kernel's output in one arena).
    last_write: Vec<Option<(Stream, u64)>>,
    /// Per stream, the latest operation that wrote any word here: when another stream
    /// has waited for each of these, no word can race, and a launch that names the
    /// whole allocation need not read `last_write` word by word.
    writers: Vec<(Stream, u64)>,
    /// Every byte is written: set by a check that found it so, cleared when part of the
    /// allocation is made fresh (writes only ever set `written`).
    all_written: std::cell::Cell<bool>,
}

impl Allocation {
    fn words(start: usize, end: usize) -> std::ops::Range<usize> {
        start / 4..end.div_ceil(4)
    }

    /// Marks words `start..end` (bytes) last written by operation `op` of stream `s`.
    fn last_written(&mut self, s: Stream, op: u64, start: usize, end: usize) {
        self.last_write[Self::words(start, end)].fill(Some((s, op)));
        match self.writers.iter_mut().find(|(w, _)| *w == s) {
            Some(latest) => latest.1 = latest.1.max(op),
            None => self.writers.push((s, op)),
        }
    }

    fn wrote(&mut self, s: Stream, op: u64, start: usize, end: usize) {
        self.written[start..end].fill(true);
        self.last_written(s, op, start, end);
    }
}

/// One captured operation: recorded, not run, while its stream is captured; run by
/// [`EmuDevice::replay`].
#[derive(Clone, Debug, PartialEq)]
pub enum Captured {
    /// A memset.
    Memset {
        /// Where.
        dst: (DevPtr, usize),
        /// The byte.
        value: u8,
        /// Bytes.
        len: usize,
    },
    /// A launch with its declared accesses (the kernel runs on replay through the
    /// caller, which the graph hands back in order).
    Launch {
        /// The caller's label for it.
        label: String,
        /// Allocations it reads.
        reads: Vec<DevPtr>,
        /// Allocations it writes.
        writes: Vec<DevPtr>,
    },
}

/// Runs a replayed launch's kernel: its label and its allocations' host addresses.
pub type KernelRunner<'a> = dyn FnMut(&str, &mut [*mut u8]) -> Result<(), String> + 'a;

/// Where an event was recorded: the stream, its operation number, and what it had
/// waited for by then.
type Recorded = (Stream, u64, HashMap<Stream, u64>);

/// The emulated device.
#[derive(Default)]
pub struct EmuDevice {
    allocs: BTreeMap<DevPtr, Allocation>,
    next_ptr: u64,
    /// Per stream: operations issued so far, and for each other stream the operation
    /// number up to which this stream has waited on it (through events).
    streams: HashMap<Stream, (u64, HashMap<Stream, u64>)>,
    /// Per event: the stream and operation number it was recorded at, and what that
    /// stream had waited for by then (ordering is transitive, as on a GPU: a stream
    /// waiting on it is ordered after everything its recorder was ordered after).
    events: HashMap<Event, Option<Recorded>>,
    capturing: Option<(Stream, Vec<Captured>)>,
    next_id: u32,
}

impl EmuDevice {
    /// A device with stream 0.
    pub fn new() -> EmuDevice {
        let mut d = EmuDevice {
            next_ptr: 1 << 20,
            ..EmuDevice::default()
        };
        d.streams.insert(Stream(0), (0, HashMap::new()));
        d
    }

    /// A new stream.
    pub fn stream(&mut self) -> Stream {
        self.next_id += 1;
        let s = Stream(self.next_id);
        self.streams.insert(s, (0, HashMap::new()));
        s
    }

    /// A new event, never recorded.
    pub fn event(&mut self) -> Event {
        self.next_id += 1;
        let e = Event(self.next_id);
        self.events.insert(e, None);
        e
    }

    /// Allocates `size` bytes (contents never written).
    pub fn alloc(&mut self, size: usize) -> Result<DevPtr, EmuFault> {
        if let Some((s, _)) = &self.capturing {
            return Err(EmuFault::DuringCapture("memory allocated", *s));
        }
        let p = DevPtr(self.next_ptr);
        self.next_ptr += (size.max(1) as u64).div_ceil(256) * 256 + 256;
        self.allocs.insert(
            p,
            Allocation {
                bytes: POISON.repeat(size.div_ceil(4))[..size].to_vec(),
                written: vec![false; size],
                last_write: vec![None; size.div_ceil(4)],
                writers: Vec::new(),
                all_written: std::cell::Cell::new(size == 0),
            },
        );
        Ok(p)
    }

    /// Frees an allocation.
    pub fn free(&mut self, p: DevPtr) -> Result<(), EmuFault> {
        if let Some((s, _)) = &self.capturing {
            return Err(EmuFault::DuringCapture("memory freed", *s));
        }
        self.allocs
            .remove(&p)
            .map(|_| ())
            .ok_or_else(|| EmuFault::Misuse(format!("freeing {p:?}, which is not allocated")))
    }

    fn tick(&mut self, s: Stream) -> Result<u64, EmuFault> {
        let (ops, _) = self
            .streams
            .get_mut(&s)
            .ok_or_else(|| EmuFault::Misuse(format!("no stream {s:?}")))?;
        *ops += 1;
        Ok(*ops)
    }

    /// Checks that `s` may touch `p` (ordered after its last write) and that
    /// `start..end` lies inside it.
    fn touch(
        &self,
        s: Stream,
        p: DevPtr,
        (start, end): (usize, usize),
        write: bool,
        what: &str,
    ) -> Result<(), EmuFault> {
        let a = self.allocs.get(&p).ok_or_else(|| EmuFault::OutOfBounds {
            ptr: p,
            start,
            end,
            size: 0,
            what: what.to_string(),
        })?;
        if end > a.bytes.len() || start > end {
            return Err(EmuFault::OutOfBounds {
                ptr: p,
                start,
                end,
                size: a.bytes.len(),
                what: what.to_string(),
            });
        }
        let waits = self.streams.get(&s).map(|(_, w)| w);
        let waited = |writer: &Stream| waits.and_then(|w| w.get(writer)).copied().unwrap_or(0);
        if a.writers.iter().all(|(w, op)| *w == s || waited(w) >= *op) {
            return Ok(());
        }
        let mut last = None;
        for (writer, op) in a.last_write[Allocation::words(start, end)].iter().flatten() {
            if *writer == s || last == Some((*writer, *op)) {
                continue;
            }
            last = Some((*writer, *op));
            let (writer, op) = (*writer, *op);
            if waited(&writer) < op {
                return Err(EmuFault::Race {
                    ptr: p,
                    writer,
                    op,
                    now: s,
                    what: if write { "writes" } else { "reads" },
                });
            }
        }
        Ok(())
    }

    fn check_written(
        &self,
        p: DevPtr,
        start: usize,
        end: usize,
        what: &str,
    ) -> Result<(), EmuFault> {
        let a = &self.allocs[&p];
        if a.all_written.get() {
            return Ok(());
        }
        if let Some(k) = a.written[start..end].iter().position(|w| !w) {
            return Err(EmuFault::Uninitialised {
                ptr: p,
                start: start + k,
                end,
                what: what.to_string(),
            });
        }
        if start == 0 && end == a.written.len() {
            a.all_written.set(true);
        }
        Ok(())
    }

    fn wrote(&mut self, s: Stream, op: u64, p: DevPtr, start: usize, end: usize) {
        self.allocs
            .get_mut(&p)
            .expect("checked")
            .wrote(s, op, start, end);
    }

    /// Copies host bytes into `p` at `offset`, on stream `s`.
    pub fn copy_htod(
        &mut self,
        s: Stream,
        p: DevPtr,
        offset: usize,
        src: &[u8],
    ) -> Result<(), EmuFault> {
        let end = offset + src.len();
        self.touch(s, p, (offset, end), true, "a host-to-device copy")?;
        let op = self.tick(s)?;
        self.allocs.get_mut(&p).expect("checked").bytes[offset..end].copy_from_slice(src);
        self.wrote(s, op, p, offset, end);
        Ok(())
    }

    /// Copies `dst.len()` bytes of `p` from `offset` to the host, on stream `s`.
    pub fn copy_dtoh(
        &mut self,
        s: Stream,
        p: DevPtr,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), EmuFault> {
        let end = offset + dst.len();
        self.touch(s, p, (offset, end), false, "a device-to-host copy")?;
        self.check_written(p, offset, end, "a device-to-host copy")?;
        self.tick(s)?;
        dst.copy_from_slice(&self.allocs[&p].bytes[offset..end]);
        Ok(())
    }

    /// Sets `len` bytes of `p` from `offset` to `value`, on stream `s` (recorded when
    /// capturing).
    pub fn memset(
        &mut self,
        s: Stream,
        p: DevPtr,
        offset: usize,
        value: u8,
        len: usize,
    ) -> Result<(), EmuFault> {
        let end = offset + len;
        self.touch(s, p, (offset, end), true, "a memset")?;
        if self.is_capturing(s) {
            return self.record(
                s,
                Captured::Memset {
                    dst: (p, offset),
                    value,
                    len,
                },
            );
        }
        let op = self.tick(s)?;
        self.allocs.get_mut(&p).expect("checked").bytes[offset..end].fill(value);
        self.wrote(s, op, p, offset, end);
        Ok(())
    }

    /// The allocation holding `len` bytes at device address `addr`, and the offset.
    pub fn locate(&self, addr: u64, len: usize, what: &str) -> Result<(DevPtr, usize), EmuFault> {
        let hit = self.allocs.range(..=DevPtr(addr)).next_back();
        match hit {
            Some((p, a)) if addr - p.0 <= a.bytes.len() as u64 => {
                let off = (addr - p.0) as usize;
                if off + len > a.bytes.len() {
                    return Err(EmuFault::OutOfBounds {
                        ptr: *p,
                        start: off,
                        end: off + len,
                        size: a.bytes.len(),
                        what: what.to_string(),
                    });
                }
                Ok((*p, off))
            }
            _ => Err(EmuFault::OutOfBounds {
                ptr: DevPtr(addr),
                start: 0,
                end: len,
                size: 0,
                what: what.to_string(),
            }),
        }
    }

    /// Marks `len` bytes at `addr` as never written (poisoned), as a buffer is before
    /// the node that computes it runs.
    pub fn fresh(&mut self, addr: u64, len: usize) -> Result<(), EmuFault> {
        let (p, off) = self.locate(addr, len, "a fresh buffer")?;
        let a = self.allocs.get_mut(&p).expect("located");
        for (k, b) in a.bytes[off..off + len].iter_mut().enumerate() {
            *b = POISON[(off + k) % 4];
        }
        a.written[off..off + len].fill(false);
        if len > 0 {
            a.all_written.set(false);
        }
        Ok(())
    }

    /// Checks and runs a launch on stream `s` that touches `touches`: each must lie in
    /// an allocation, be ordered after its last write by another stream, and have its
    /// leading `must_be_written` bytes written. The kernel gets, for each, a copy with
    /// [`GUARD`] bytes of poison on both sides (8-aligned): a write into the guard is
    /// out of bounds, a read there or of a never-written word gives NaN. Afterwards
    /// the words a kernel changed in a written buffer count as written. While `s` is
    /// captured, only the bounds are checked (the caller records the launch).
    pub fn run(
        &mut self,
        s: Stream,
        what: &str,
        touches: &[Touch],
        kernel: impl FnOnce(&mut [*mut u8]) -> Result<(), String>,
    ) -> Result<(), EmuFault> {
        let mut at = Vec::with_capacity(touches.len());
        for t in touches {
            at.push(self.locate(t.addr, t.len, what)?);
        }
        // Nothing runs while capturing, so what memory holds then says nothing about
        // the replay: the ordering and written checks run at each replay.
        if self.is_capturing(s) {
            return Ok(());
        }
        for (t, &(p, off)) in touches.iter().zip(&at) {
            self.touch(s, p, (off, off + t.len), t.write, what)?;
            self.check_written(p, off, off + t.must_be_written.min(t.len), what)?;
        }
        let op = self.tick(s)?;
        let mut copies: Vec<Vec<u64>> = touches
            .iter()
            .zip(&at)
            .map(|(t, (p, off))| {
                let mut buf =
                    vec![
                        u64::from_ne_bytes([POISON, POISON].concat().try_into().expect("8"));
                        (t.len + 2 * GUARD).div_ceil(8)
                    ];
                let bytes = bytes_of_mut(&mut buf);
                bytes[GUARD..GUARD + t.len]
                    .copy_from_slice(&self.allocs[p].bytes[*off..off + t.len]);
                buf
            })
            .collect();
        let mut ptrs: Vec<*mut u8> = copies
            .iter_mut()
            .map(|c| bytes_of_mut(c)[GUARD..].as_mut_ptr())
            .collect();
        kernel(&mut ptrs).map_err(EmuFault::Misuse)?;
        for (k, (t, (p, off))) in touches.iter().zip(&at).enumerate() {
            let c = bytes_of_mut(&mut copies[k]);
            // The poison lies word-aligned from the copy's start, so a guard byte is
            // checked against its own position (a 2-byte tensor's length need not be a
            // multiple of 4).
            let guard_hit = (0..GUARD)
                .chain(GUARD + t.len..c.len())
                .find(|&at| c[at] != POISON[at % 4])
                .map(|at| if at < GUARD { at } else { at - t.len });
            if let Some(i) = guard_hit {
                let (start, end) = if i < GUARD {
                    (0, GUARD - i)
                } else {
                    (t.len, t.len + i - GUARD + 1)
                };
                return Err(EmuFault::OutOfBounds {
                    ptr: *p,
                    start: if i < GUARD { 0 } else { off + start },
                    end: off + end,
                    size: t.len,
                    what: format!(
                        "{what} (buffer {k}, {} bytes at offset {off}: it wrote {} its end)",
                        t.len,
                        if i < GUARD { "before" } else { "past" }
                    ),
                });
            }
            if !t.write {
                continue;
            }
            let a = self.allocs.get_mut(p).expect("located");
            let new = &c[GUARD..GUARD + t.len];
            let old = &mut a.bytes[*off..off + t.len];
            for w in (0..t.len).step_by(4) {
                let e = (w + 4).min(t.len);
                if new[w..e] != old[w..e] {
                    a.written[off + w..off + e].fill(true);
                }
            }
            old.copy_from_slice(new);
            a.last_written(s, op, *off, off + t.len);
        }
        Ok(())
    }

    /// Checks and records a kernel launch on stream `s` that reads `reads` whole and
    /// writes `writes` (whole allocations, as the backend's launches declare them),
    /// then runs `kernel` (which gets each allocation's host address in order: reads,
    /// then writes).
    pub fn launch(
        &mut self,
        s: Stream,
        label: &str,
        reads: &[DevPtr],
        writes: &[DevPtr],
        kernel: impl FnOnce(&mut [*mut u8]) -> Result<(), String>,
    ) -> Result<(), EmuFault> {
        let what = format!("kernel `{label}`");
        for &p in reads {
            let len = self.allocs.get(&p).map_or(0, |a| a.bytes.len());
            self.touch(s, p, (0, len), false, &what)?;
            self.check_written(p, 0, len, &what)?;
        }
        for &p in writes {
            let len = self.allocs.get(&p).map_or(0, |a| a.bytes.len());
            self.touch(s, p, (0, len), true, &what)?;
        }
        if self.is_capturing(s) {
            return self.record(
                s,
                Captured::Launch {
                    label: label.to_string(),
                    reads: reads.to_vec(),
                    writes: writes.to_vec(),
                },
            );
        }
        let op = self.tick(s)?;
        let mut ptrs: Vec<*mut u8> = reads
            .iter()
            .chain(writes)
            .map(|p| self.allocs.get_mut(p).expect("checked").bytes.as_mut_ptr())
            .collect();
        kernel(&mut ptrs).map_err(EmuFault::Misuse)?;
        for &p in writes {
            let len = self.allocs[&p].bytes.len();
            self.wrote(s, op, p, 0, len);
        }
        Ok(())
    }

    /// Records stream `s`'s position in `e`.
    pub fn record_event(&mut self, s: Stream, e: Event) -> Result<(), EmuFault> {
        let (ops, waited) = self
            .streams
            .get(&s)
            .map(|(ops, waited)| (*ops, waited.clone()))
            .ok_or_else(|| EmuFault::Misuse(format!("no stream {s:?}")))?;
        let slot = self
            .events
            .get_mut(&e)
            .ok_or_else(|| EmuFault::Misuse(format!("no event {e:?}")))?;
        *slot = Some((s, ops, waited));
        Ok(())
    }

    /// Makes stream `s` wait for event `e`: what its stream did before it is ordered
    /// before what `s` does next.
    pub fn wait_event(&mut self, s: Stream, e: Event) -> Result<(), EmuFault> {
        let Some(Some((other, at, before))) = self.events.get(&e).cloned() else {
            return Err(EmuFault::Misuse(format!(
                "stream {s:?} waits on event {e:?}, never recorded"
            )));
        };
        let (_, waited) = self
            .streams
            .get_mut(&s)
            .ok_or_else(|| EmuFault::Misuse(format!("no stream {s:?}")))?;
        for (t, n) in before.into_iter().chain([(other, at)]) {
            let w = waited.entry(t).or_insert(0);
            *w = (*w).max(n);
        }
        Ok(())
    }

    fn record(&mut self, s: Stream, op: Captured) -> Result<(), EmuFault> {
        match &mut self.capturing {
            Some((cs, ops)) if *cs == s => {
                ops.push(op);
                Ok(())
            }
            _ => Err(EmuFault::Misuse(format!("{s:?} is not being captured"))),
        }
    }

    /// Runs a captured graph on stream `s`, every operation with its checks;
    /// `kernel(label, pointers)` runs a captured launch's kernel.
    pub fn replay(
        &mut self,
        s: Stream,
        graph: &[Captured],
        kernel: &mut KernelRunner<'_>,
    ) -> Result<(), EmuFault> {
        for op in graph {
            match op {
                Captured::Memset { dst, value, len } => {
                    self.memset(s, dst.0, dst.1, *value, *len)?
                }
                Captured::Launch {
                    label,
                    reads,
                    writes,
                } => self.launch(s, label, reads, writes, |p| kernel(label, p))?,
            }
        }
        Ok(())
    }

    /// Starts capturing stream `s`.
    pub fn begin_capture(&mut self, s: Stream) -> Result<(), EmuFault> {
        if let Some((c, _)) = &self.capturing {
            return Err(EmuFault::Misuse(format!(
                "capture begun on {s:?} while {c:?} is being captured"
            )));
        }
        self.capturing = Some((s, Vec::new()));
        Ok(())
    }

    /// Ends the capture of `s`, handing back its operations (a graph).
    pub fn end_capture(&mut self, s: Stream) -> Result<Vec<Captured>, EmuFault> {
        match self.capturing.take() {
            Some((c, ops)) if c == s => Ok(ops),
            other => {
                self.capturing = other;
                Err(EmuFault::Misuse(format!("{s:?} is not being captured")))
            }
        }
    }

    /// Whether stream `s` is being captured.
    pub fn is_capturing(&self, s: Stream) -> bool {
        self.capturing.as_ref().is_some_and(|(c, _)| *c == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream ordered after another only through a third (its event recorded after
    /// it waited on the writer's) reads the write without a race, as on a GPU; a
    /// stream that never waited races.
    #[test]
    fn ordering_through_events_is_transitive() {
        let mut d = EmuDevice::new();
        let (writer, middle, reader, stranger) = (d.stream(), d.stream(), d.stream(), d.stream());
        let p = d.alloc(8).expect("alloc");
        d.copy_htod(writer, p, 0, &[1; 8]).expect("write");
        let (wrote, passed) = (d.event(), d.event());
        d.record_event(writer, wrote).expect("record");
        d.wait_event(middle, wrote).expect("wait");
        d.record_event(middle, passed).expect("record");
        d.wait_event(reader, passed).expect("wait");
        let mut back = [0u8; 8];
        d.copy_dtoh(reader, p, 0, &mut back)
            .expect("ordered through the middle");
        assert_eq!(back, [1; 8]);
        let e = d
            .copy_dtoh(stranger, p, 0, &mut back)
            .expect_err("never waited");
        assert!(matches!(e, EmuFault::Race { .. }), "{e}");
    }
}
