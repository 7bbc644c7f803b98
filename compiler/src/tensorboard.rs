//! TensorBoard event files (`--tensorboard DIR`): every number of a step's metrics line
//! as a scalar of that step, so TensorBoard shows what the JSONL metrics hold (losses,
//! learning rate, throughput, MFU, memory, each worker's bytes and each pipeline stage's
//! account) under the line's own names, `/` joining a nested field (`memory/params`,
//! `bytes_sent_per_worker/1`, `pipeline/stages/0/busy_sec`).
//!
//! The file is TensorFlow's record format (a length, its masked CRC-32C, the record, its
//! masked CRC-32C) of `Event` protocol buffers, encoded with `prost` from the fields of
//! TensorFlow's `event.proto` and `summary.proto` that scalars use.

use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorflow.Event`: the fields a scalar summary uses.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `brain.Event:2` in a file's first event.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// The scalars of the step.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// One value a tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` holding a `simple_value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The scalar's name.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Its value.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// A record's CRC-32C, masked as TensorFlow's record format masks it.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record of the format: `len`, its masked CRC, the bytes, their masked CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The records of `bytes`, each checked against its CRCs.
pub fn read_records(bytes: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let head = bytes
            .get(at..at + 12)
            .ok_or_else(|| format!("a record cut short at byte {at}"))?;
        let len = u64::from_le_bytes(head[..8].try_into().map_err(|_| "length")?) as usize;
        let crc = u32::from_le_bytes(head[8..12].try_into().map_err(|_| "crc")?);
        if crc != masked_crc(&head[..8]) {
            return Err(format!("the length at byte {at} fails its CRC"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| format!("a record of {len} bytes cut short at byte {at}"))?;
        let tail = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| format!("a record's CRC cut short at byte {at}"))?;
        if u32::from_le_bytes(tail.try_into().map_err(|_| "crc")?) != masked_crc(data) {
            return Err(format!("the record at byte {at} fails its CRC"));
        }
        out.push(data.to_vec());
        at += 16 + len;
    }
    Ok(out)
}

/// The events of an event file's bytes (its records checked and decoded).
pub fn read_events(bytes: &[u8]) -> std::result::Result<Vec<Event>, String> {
    read_records(bytes)?
        .iter()
        .map(|r| <Event as prost::Message>::decode(r.as_slice()).map_err(|e| e.to_string()))
        .collect()
}

/// Every number of `value`, by its path of names (`/` between): what a metrics line
/// holds as scalars.
fn scalars(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}/{k}")
        }
    };
    match value {
        serde_json::Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((prefix.to_string(), x));
            }
        }
        serde_json::Value::Bool(b) => out.push((prefix.to_string(), f64::from(u8::from(*b)))),
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                scalars(&join(k), v, out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                scalars(&join(&i.to_string()), v, out);
            }
        }
        serde_json::Value::Null | serde_json::Value::String(_) => {}
    }
}

/// An event file being written, one event a step, flushed as written (TensorBoard
/// reads a file while the run goes on, and a run stopped by mpirun keeps its steps).
pub struct EventWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl EventWriter {
    /// A new event file in `dir` (created if needed), named as TensorBoard looks for
    /// them: `events.out.tfevents.SECONDS.HOST.PID.distc`. An error names the path.
    pub fn create(dir: &Path) -> Result<EventWriter, (PathBuf, std::io::Error)> {
        std::fs::create_dir_all(dir).map_err(|e| (dir.to_path_buf(), e))?;
        let now = now();
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
            .unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.distc",
            now as u64,
            std::process::id()
        ));
        let file = std::fs::File::create(&path).map_err(|e| (path.clone(), e))?;
        let mut w = EventWriter {
            path,
            file: std::io::BufWriter::new(file),
        };
        w.write(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })
        .map_err(|e| (w.path.clone(), e))?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The step's metrics line as one event of scalars.
    pub fn step(&mut self, step: usize, line: &serde_json::Value) -> std::io::Result<()> {
        let mut values = Vec::new();
        scalars("", line, &mut values);
        let value = values
            .into_iter()
            .filter(|(tag, _)| tag != "step")
            .map(|(tag, x)| SummaryValue {
                tag,
                simple_value: Some(x as f32),
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    fn write(&mut self, e: &Event) -> std::io::Result<()> {
        let data = prost::Message::encode_to_vec(e);
        self.file
            .write_all(&record(&data))
            .and_then(|()| self.file.flush())
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's check value (RFC 3720's `123456789`), and records read back.
    #[test]
    fn the_record_format_is_tensorflows() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let r = record(b"abc");
        assert_eq!(r.len(), 3 + 16);
        assert_eq!(read_records(&r).expect("reads"), vec![b"abc".to_vec()]);
        let mut bad = r.clone();
        bad[13] ^= 1;
        assert!(read_records(&bad)
            .expect_err("damaged")
            .contains("fails its CRC"));
    }

    #[test]
    fn a_metrics_line_becomes_its_numbers_by_path() {
        let line = serde_json::json!({
            "step": 3, "loss": 2.5, "memory": {"params": 10},
            "bytes_sent_per_worker": [1, 2], "eval_device": "cpu",
            "pipeline": {"stages": [{"busy_sec": 0.5}]}
        });
        let mut out = Vec::new();
        scalars("", &line, &mut out);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        let tags: Vec<&str> = out.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            tags,
            [
                "bytes_sent_per_worker/0",
                "bytes_sent_per_worker/1",
                "loss",
                "memory/params",
                "pipeline/stages/0/busy_sec",
                "step"
            ]
        );
    }
}
