//! The Horovod-style timeline (`--timeline FILE`, HOROVOD_TIMELINE), as Horovod's
//! horovod/common/timeline.cc writes it, so that a Horovod user reads it in chrome://tracing or
//! Perfetto as they read Horovod's:
//! - rank 0 writes it (the coordinator's view); every tensor is a row ("process") named after
//!   the tensor (`allreduce.<parameter name>`);
//! - per tensor: `NEGOTIATE_ALLREDUCE` from the first rank's report to the last (a tick named
//!   after each rank as its report reaches rank 0), then `ALLREDUCE` holding the activities
//!   `WAIT_FOR_DATA` (GPU tensors), `MEMCPY_IN_FUSION_BUFFER`, `MPI_ALLREDUCE` (or
//!   `MPI_REDUCE`, `MPI_ALLREDUCE`, `MPI_BCAST` when hierarchical) and
//!   `MEMCPY_OUT_FUSION_BUFFER`, its end carrying the tensor's dtype and shape;
//! - activity only: an idle cycle writes nothing (`HOROVOD_TIMELINE_MARK_CYCLES=1` adds a
//!   `CYCLE_START` mark per cycle, as in Horovod);
//! - the file is a JSON array streamed as the run goes: a writer thread appends each batch of
//!   events as soon as the background thread hands it over (Horovod's writer thread does the
//!   same) and, as Horovod does, ends every write with the closing `]`, writing the next batch
//!   over it. A run that dies leaves the events written so far; if it dies inside a write the
//!   array may lack its closing bracket, which chrome://tracing accepts (the trace format makes
//!   it optional).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::json;

use crate::error::{Error, Result};

/// Where a tensor is in the timeline (Horovod's `TimelineState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Negotiating,
    TopLevel,
    Activity,
}

pub struct Timeline {
    records: Option<Sender<String>>,
    /// Why the writer stopped writing, if it did (a full disk): the run ends non-zero.
    failure: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    writer: Option<JoinHandle<()>>,
    start: Instant,
    /// Row ("pid") of every tensor name seen, from 1 (row 0 holds the file's own metadata).
    rows: HashMap<Arc<str>, u32>,
    states: HashMap<Arc<str>, State>,
}

impl Timeline {
    /// Creates (or empties) `path`, writes the array's opening metadata, and starts the writer.
    pub fn create(path: &Path) -> Result<Timeline> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let mut file = File::create(path).map_err(|e| Error::io(path, e))?;
        let epoch_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let header = [
            json!({ "name": "process_name", "ph": "M", "pid": 0, "args": { "start_time_since_epoch_in_micros": epoch_us } }),
            json!({ "name": "process_sort_index", "ph": "M", "pid": 0, "args": { "sort_index": 0 } }),
        ];
        let text = format!("[\n{}]", header.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",\n"));
        file.write_all(text.as_bytes()).map_err(|e| Error::io(path, e))?;
        let (records, inbox) = channel();
        let owned = path.to_path_buf();
        let length = text.len() as u64;
        let failure = std::sync::Arc::new(std::sync::Mutex::new(None));
        let noted = failure.clone();
        let writer = std::thread::Builder::new()
            .name("horovod-timeline".into())
            .spawn(move || {
                if let Err(why) = write_batches(file, length, &owned, inbox) {
                    *noted.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                }
            })
            .map_err(|e| Error::exchange("horovod", format!("cannot start the timeline writer: {e}")))?;
        Ok(Timeline { records: Some(records), failure, writer: Some(writer), start: Instant::now(), rows: HashMap::new(), states: HashMap::new() })
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn send(&self, record: serde_json::Value) {
        if let Some(records) = &self.records {
            let _ = records.send(record.to_string());
        }
    }

    /// The row of `tensor`, announced (name and order) the first time it is seen.
    fn row(&mut self, tensor: &Arc<str>) -> u32 {
        if let Some(&row) = self.rows.get(tensor) {
            return row;
        }
        let row = self.rows.len() as u32 + 1;
        self.rows.insert(tensor.clone(), row);
        self.send(json!({ "name": "process_name", "ph": "M", "pid": row, "args": { "name": &**tensor } }));
        self.send(json!({ "name": "process_sort_index", "ph": "M", "pid": row, "args": { "sort_index": row } }));
        row
    }

    fn begin(&mut self, tensor: &Arc<str>, name: &str) {
        let (pid, ts) = (self.row(tensor), self.now_us());
        self.send(json!({ "ph": "B", "name": name, "ts": ts, "pid": pid }));
    }

    fn finish(&mut self, tensor: &Arc<str>, args: Option<serde_json::Value>) {
        let (pid, ts) = (self.row(tensor), self.now_us());
        let mut event = json!({ "ph": "E", "ts": ts, "pid": pid });
        if let Some(args) = args {
            event["args"] = args;
        }
        self.send(event);
    }

    /// A rank has the tensor ready and rank 0 has not seen all ranks' yet. Repeated calls while
    /// it negotiates change nothing (the first counts, as in Horovod).
    pub fn negotiate_start(&mut self, tensor: &Arc<str>) {
        if self.states.get(tensor) == Some(&State::Negotiating) {
            return;
        }
        self.begin(tensor, "NEGOTIATE_ALLREDUCE");
        self.states.insert(tensor.clone(), State::Negotiating);
    }

    /// `rank`'s report of the tensor reached rank 0.
    pub fn negotiate_rank_ready(&mut self, tensor: &Arc<str>, rank: usize) {
        let (pid, ts) = (self.row(tensor), self.now_us());
        self.send(json!({ "ph": "X", "name": rank.to_string(), "ts": ts, "pid": pid, "dur": 0 }));
    }

    /// Every rank has the tensor ready.
    pub fn negotiate_end(&mut self, tensor: &Arc<str>) {
        if self.states.remove(tensor) == Some(State::Negotiating) {
            self.finish(tensor, None);
        }
    }

    /// The reduction of the tensor starts (`op`: ALLREDUCE).
    pub fn start(&mut self, tensor: &Arc<str>, op: &str) {
        self.negotiate_end(tensor);
        self.begin(tensor, op);
        self.states.insert(tensor.clone(), State::TopLevel);
    }

    pub fn activity_start(&mut self, tensor: &Arc<str>, activity: &str) {
        if self.states.get(tensor) == Some(&State::Activity) {
            self.activity_end(tensor);
        }
        self.begin(tensor, activity);
        self.states.insert(tensor.clone(), State::Activity);
    }

    pub fn activity_end(&mut self, tensor: &Arc<str>) {
        if self.states.get(tensor) == Some(&State::Activity) {
            self.finish(tensor, None);
            self.states.insert(tensor.clone(), State::TopLevel);
        }
    }

    /// The reduction of the tensor is done: `dtype` and `shape` go into the event's arguments.
    pub fn end(&mut self, tensor: &Arc<str>, dtype: &str, shape: &[i64]) {
        self.activity_end(tensor);
        self.states.remove(tensor);
        let shape = format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "));
        self.finish(tensor, Some(json!({ "dtype": dtype, "shape": shape })));
    }

    /// The tensor now has another name (overlap rebuilt its buckets after the first step): what
    /// is open on the old row is closed there, and a negotiation under way goes on in the new.
    pub fn rename(&mut self, old: &Arc<str>, new: &Arc<str>) {
        if old == new {
            return;
        }
        match self.states.remove(old) {
            Some(State::Negotiating) => {
                self.finish(old, None);
                self.negotiate_start(new);
            }
            Some(State::Activity) => {
                self.finish(old, None);
                self.finish(old, None);
            }
            Some(State::TopLevel) => self.finish(old, None),
            None => {}
        }
    }

    /// HOROVOD_TIMELINE_MARK_CYCLES: a global instant mark at each cycle's start.
    pub fn mark_cycle_start(&mut self) {
        let ts = self.now_us();
        self.send(json!({ "ph": "i", "name": "CYCLE_START", "ts": ts, "s": "g" }));
    }
}

impl Timeline {
    /// Lets the writer write what it has, waits for it, and says why the timeline is
    /// incomplete, if it is.
    pub fn close(mut self) -> Option<String> {
        self.stop_writer();
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn stop_writer(&mut self) {
        drop(self.records.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl Drop for Timeline {
    /// Lets the writer write what it has and waits for it.
    fn drop(&mut self) {
        self.stop_writer();
    }
}

/// The writer thread: appends each batch of records (what has arrived when it wakes) over the
/// closing `]` that ends the file, and a new `]` after them, in one write. `length`: the file's
/// length, whose last byte is that `]`. A failed write is reported once; the run goes on
/// without a timeline, as Horovod's does, and the reason comes back at the end (the run then
/// ends non-zero, after its record: see `Horovod::finish`).
fn write_batches(file: File, mut length: u64, path: &Path, inbox: Receiver<String>) -> std::result::Result<(), String> {
    let mut failed: Option<String> = None;
    while let Ok(first) = inbox.recv() {
        let mut batch = String::with_capacity(4096);
        batch.push_str(",\n");
        batch.push_str(&first);
        while let Ok(more) = inbox.try_recv() {
            batch.push_str(",\n");
            batch.push_str(&more);
            if batch.len() > 4 << 20 {
                break;
            }
        }
        batch.push(']');
        if failed.is_some() {
            continue;
        }
        match file.write_all_at(batch.as_bytes(), length - 1) {
            Ok(()) => length += batch.len() as u64 - 1,
            Err(e) => {
                // A write cut short (a full disk) is taken back: the file keeps every earlier
                // event and its closing bracket.
                let _ = file.set_len(length);
                log::warn!("horovod timeline: writing {} failed ({e}); the rest of the run writes no timeline", path.display());
                failed = Some(format!("the timeline {} is incomplete: writing it failed ({e}); it holds the events before that", path.display()));
            }
        }
    }
    failed.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hpc-train-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("timeline.json")
    }

    #[test]
    fn a_tensor_row_holds_negotiation_then_its_activities() {
        let path = scratch("timeline-rows");
        let mut t = Timeline::create(&path).unwrap();
        let a: Arc<str> = Arc::from("allreduce.fc.weight");
        let b: Arc<str> = Arc::from("allreduce.fc.bias");
        t.negotiate_start(&a);
        t.negotiate_start(&a); // repeated: ignored
        t.negotiate_rank_ready(&a, 1);
        t.negotiate_end(&a);
        t.start(&a, "ALLREDUCE");
        t.activity_start(&a, "MEMCPY_IN_FUSION_BUFFER");
        t.activity_start(&a, "MPI_ALLREDUCE"); // ends the previous activity first
        t.end(&a, "HOROVOD_FLOAT32", &[10, 4]);
        t.start(&b, "ALLREDUCE"); // no negotiation seen (cached on every rank at once)
        t.end(&b, "HOROVOD_FLOAT32", &[10]);
        drop(t);
        let text = std::fs::read_to_string(&path).unwrap();
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a complete file is strict JSON");
        let rows: HashMap<String, u64> = events
            .iter()
            .filter(|e| e["name"] == "process_name" && e["args"]["name"].is_string())
            .map(|e| (e["args"]["name"].as_str().unwrap().to_string(), e["pid"].as_u64().unwrap()))
            .collect();
        assert_eq!(rows.len(), 2);
        let of = |row: u64| -> Vec<String> {
            events
                .iter()
                .filter(|e| e["pid"] == row && e["ph"] != "M")
                .map(|e| format!("{}:{}", e["ph"].as_str().unwrap(), e["name"].as_str().unwrap_or("")))
                .collect()
        };
        assert_eq!(
            of(rows["allreduce.fc.weight"]),
            ["B:NEGOTIATE_ALLREDUCE", "X:1", "E:", "B:ALLREDUCE", "B:MEMCPY_IN_FUSION_BUFFER", "E:", "B:MPI_ALLREDUCE", "E:", "E:"]
        );
        assert_eq!(of(rows["allreduce.fc.bias"]), ["B:ALLREDUCE", "E:"]);
        let last = events.iter().rev().find(|e| e["pid"] == rows["allreduce.fc.weight"]).unwrap();
        assert_eq!(last["args"]["shape"], "[10, 4]");
        // Timestamps never go back.
        let ts: Vec<u64> = events.iter().filter_map(|e| e["ts"].as_u64()).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
    }

    #[test]
    fn a_renamed_tensor_closes_its_old_row_and_negotiates_on_in_the_new() {
        let path = scratch("timeline-rename");
        let mut t = Timeline::create(&path).unwrap();
        let (old, new): (Arc<str>, Arc<str>) = (Arc::from("allreduce.bucket0 (a .. b)"), Arc::from("allreduce.bucket0 (b .. a)"));
        t.negotiate_start(&old);
        t.rename(&old, &new);
        t.negotiate_end(&new);
        t.start(&new, "ALLREDUCE");
        t.end(&new, "HOROVOD_FLOAT32", &[3]);
        drop(t);
        let events: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for row in [1, 2] {
            let begins = events.iter().filter(|e| e["pid"] == row && e["ph"] == "B").count();
            let ends = events.iter().filter(|e| e["pid"] == row && e["ph"] == "E").count();
            assert_eq!(begins, ends, "row {row}: every begin ends");
        }
        assert_eq!(events.iter().filter(|e| e["pid"] == 2 && e["name"] == "NEGOTIATE_ALLREDUCE").count(), 1);
    }

    #[test]
    fn the_file_is_valid_while_the_run_goes_on() {
        let path = scratch("timeline-stream");
        let mut t = Timeline::create(&path).unwrap();
        let a: Arc<str> = Arc::from("allreduce.x");
        for step in 0..50 {
            t.start(&a, "ALLREDUCE");
            t.end(&a, "HOROVOD_FLOAT32", &[step]);
        }
        // Written without the timeline being dropped: the writer streams.
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&path).unwrap();
            let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("strict JSON between writes");
            if events.iter().filter(|e| e["ph"] == "E").count() == 50 {
                break;
            }
            assert!(Instant::now() < deadline, "the writer did not write the events");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        drop(t);
    }
}
