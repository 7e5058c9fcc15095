//! A run's pipeline: the tracker's decisions come out as probe changes in
//! event order, and what it does not report is neither explained nor kept.

use std::path::PathBuf;

use super::{Pipeline, ProbeChange};
use crate::discover::{EndpointMatcher, Selector, Tracker};
use crate::event::{
    ConnEvent, ConnId, DataEvent, Direction, Event, IoCall, ListenEvent, ProcEvent,
};
use crate::model::RequestTimeline;
use crate::stitch::StitchConfig;

const AGENT_PID: u32 = 1;

fn conn(pid: u32) -> ConnId {
    ConnId {
        pid,
        fd: 7,
        sock_ino: u64::from(pid) * 100,
    }
}

fn proc_event(pid: u32) -> ProcEvent {
    ProcEvent {
        pid,
        ppid: 1,
        comm: "server".into(),
        ts: 0,
        filename: String::new(),
        exit_code: 0,
    }
}

fn listen(pid: u32, ts: u64) -> Event {
    Event::Listen(ListenEvent {
        pid,
        comm: "server".into(),
        ts,
        port: 8000,
    })
}

fn data(pid: u32, direction: Direction, ts: u64, payload: &[u8]) -> Event {
    Event::Data(DataEvent {
        conn: conn(pid),
        tid: pid,
        comm: "server".into(),
        ts_enter: ts,
        ts_exit: ts + 1,
        ingress: None,
        marks: Vec::new(),
        direction,
        call: match direction {
            Direction::Ingress => IoCall::Read,
            Direction::Egress => IoCall::Write,
        },
        len: u32::try_from(payload.len()).expect("short"),
        payload: bytes::Bytes::copy_from_slice(payload),
        addrs: None,
        tcp: None,
    })
}

/// One request and its complete response on `pid`'s connection.
fn exchange(pid: u32, ts: u64, path: &str) -> Vec<Event> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    vec![
        Event::Accept(ConnEvent {
            conn: conn(pid),
            tid: pid,
            comm: "server".into(),
            ts,
            addrs: None,
            established: None,
        }),
        data(pid, Direction::Ingress, ts + 10, request.as_bytes()),
        data(
            pid,
            Direction::Egress,
            ts + 20,
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ),
    ]
}

fn run_pipeline(demote_after: u32) -> Pipeline {
    let tracker = Tracker::new(
        Selector::default(),
        EndpointMatcher::new(&["/v1/".to_string()]),
        AGENT_PID,
        demote_after,
    );
    Pipeline::new(StitchConfig::default(), 10_000_000, 1_000_000_000)
        .with_tracker(tracker, PathBuf::from("/nonexistent-proc"))
}

#[test]
fn probe_changes_come_in_event_order_and_an_untraced_process_is_not_reported() {
    let mut pipeline = run_pipeline(2);
    let mut out: Vec<RequestTimeline> = Vec::new();
    let mut events = vec![listen(50, 1), listen(60, 2), Event::Fork(proc_event(51))];
    events.extend(exchange(60, 100, "/v1/completions"));
    events.extend(exchange(50, 200, "/health"));
    events.extend(exchange(50, 300, "/metrics"));
    events.push(Event::Exit(proc_event(50)));
    for event in &events {
        pipeline.push(event, &mut out);
    }
    assert_eq!(
        pipeline.take_probe_changes(),
        vec![
            ProbeChange::Trace(50),
            ProbeChange::Trace(60),
            ProbeChange::Rescan(51),
            ProbeChange::Untrace(50),
            ProbeChange::Exited(50),
        ]
    );
    assert!(pipeline.take_probe_changes().is_empty(), "taken once");
    let paths: Vec<&str> = out.iter().map(|t| t.path.as_str()).collect();
    assert_eq!(
        paths,
        ["/v1/completions"],
        "only the LLM endpoint is reported"
    );
}

#[test]
fn without_a_tracker_every_request_is_reported_and_nothing_is_probed() {
    let mut pipeline = Pipeline::new(StitchConfig::default(), 10_000_000, 1_000_000_000);
    let mut out = Vec::new();
    for event in exchange(50, 100, "/health")
        .iter()
        .chain(&[listen(50, 400)])
    {
        pipeline.push(event, &mut out);
    }
    assert_eq!(out.len(), 1);
    assert!(pipeline.take_probe_changes().is_empty());
}
