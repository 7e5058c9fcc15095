//! `tokentrace replay raw.pb --out DIR`: the artifacts of a recorded
//! session, rebuilt offline from its raw event stream.
//!
//! Replay drives the same [`SessionCore`] with the same events and ticks in
//! the same order as the live session did, and renders with the metadata
//! the session recorded (its wall-clock offset included), so the outputs
//! equal the live ones. No privileges needed.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::core::{Profile, Recording, SessionCore};
use super::rawpb::{record::Kind, RawReader, VERSION};
use crate::event::Event;

/// How a raw.pb file ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// With its Finish record: the replay is complete.
    Finished,
    /// Without one (the agent stopped while writing), or with a damaged
    /// record: the replay ends at the last whole record.
    Truncated(String),
}

/// Rebuilds the recording of a raw.pb file.
pub fn load(path: &Path) -> Result<(Recording, Ending)> {
    let mut reader = RawReader::open(path)?;
    let header = match reader
        .next_record()
        .with_context(|| format!("reading {}", path.display()))?
    {
        Some(Kind::Header(header)) => header,
        _ => bail!("{}: the first record is not a header", path.display()),
    };
    if header.version != VERSION {
        bail!(
            "{}: raw.pb version {} (this tokentrace reads version {VERSION})",
            path.display(),
            header.version
        );
    }
    let mut meta = header.meta();
    let mut core = SessionCore::new(&meta);
    let mut last_ts = meta.started_ns;
    let mut finish = None;
    let mut profile: Option<Profile> = None;
    let ending = loop {
        match reader.next_record() {
            Ok(Some(Kind::Event(raw))) => {
                let event = Event::try_from(raw)
                    .with_context(|| format!("{}: a malformed event", path.display()))?;
                last_ts = last_ts.max(event.order_ts());
                core.push(&event);
            }
            Ok(Some(Kind::Tick(tick))) => {
                last_ts = last_ts.max(tick.now_ns);
                core.tick(tick.now_ns);
            }
            Ok(Some(Kind::Finish(f))) => finish = Some(f),
            Ok(Some(Kind::Profile(p))) => profile = Some(Profile::from(p)),
            Ok(Some(Kind::Header(_))) => {
                bail!("{}: a second header inside the file", path.display())
            }
            Ok(None) if finish.is_some() => break Ending::Finished,
            Ok(None) => break Ending::Truncated("no Finish record".into()),
            Err(err) => break Ending::Truncated(format!("{err:#}")),
        }
    };
    let (now, samples_dropped) = match finish {
        Some(f) => {
            core.dropped(f.events_dropped);
            (f.now_ns, f.samples_dropped)
        }
        None => (last_ts, 0),
    };
    meta.ended_ns = now;
    Ok((core.finish(now, meta, profile, samples_dropped), ending))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::{meta, sse_exchange};
    use crate::session::jsonl;
    use crate::session::rawpb::RawWriter;

    /// raw.pb files written by earlier agents (raw-v1.pb by the first
    /// writer; raw-v1-stdlib-sse.pb recorded live from tests/servers/
    /// stdlib_sse.py with CPU sampling: five requests, stalls) and the
    /// artifacts those agents' replay wrote: today's replay must write the
    /// same bytes.
    #[test]
    fn recordings_from_before_replay_to_the_same_artifacts_byte_for_byte() {
        let testdata = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/session/testdata");
        for fixture in ["raw-v1", "raw-v1-stdlib-sse"] {
            let (recording, ending) =
                load(&testdata.join(format!("{fixture}.pb"))).expect("replay");
            assert_eq!(ending, Ending::Finished, "{fixture}");
            let out =
                std::env::temp_dir().join(format!("tt-golden-{}-{fixture}", std::process::id()));
            let _ = std::fs::remove_dir_all(&out);
            crate::session::write_artifacts(&out, &recording).expect("artifacts");
            for name in [
                crate::session::REPORT_HTML,
                crate::session::TRACE_JSON,
                crate::session::REQUESTS_CSV,
                crate::session::REQUESTS_JSONL,
                crate::session::FLAME_SVG,
            ] {
                // `.golden`: test data, not a source file of its kind.
                let golden = testdata
                    .join("golden")
                    .join(fixture)
                    .join(format!("{name}.golden"));
                let want = std::fs::read(&golden).expect("golden artifact");
                let got = std::fs::read(out.join(name)).expect("replayed artifact");
                assert!(
                    got == want,
                    "{fixture}: {name} differs from {} (replayed: {})",
                    golden.display(),
                    out.join(name).display()
                );
            }
            let _ = std::fs::remove_dir_all(&out);
        }
    }

    #[test]
    fn replay_reproduces_the_live_recording() {
        let dir = std::env::temp_dir().join(format!("tt-replay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let raw = dir.join("raw.pb");
        let m = meta();
        // the live side: the same calls on a core and on the writer
        let mut live = SessionCore::new(&m);
        let mut writer = RawWriter::create(&raw, &m).expect("create");
        for (i, start) in [1_100_000_000u64, 1_500_000_000].into_iter().enumerate() {
            for e in sse_exchange(start, 2 + i, &format!("/v1/chat/completions?rid={i}")) {
                live.push(&e);
                writer.event(&e).expect("event");
            }
            live.tick(start + 200_000_000);
            writer.tick(start + 200_000_000).expect("tick");
        }
        // a request cut by the session's end
        for e in &sse_exchange(2_000_000_000, 3, "/cut")[..3] {
            live.push(e);
            writer.event(e).expect("event");
        }
        live.dropped(2);
        let end = 2_500_000_000;
        let live_meta = crate::session::core::RecordingMeta {
            ended_ns: end,
            ..m.clone()
        };
        let recorded = live.finish(end, live_meta, None, 0);
        writer
            .finish(end, &recorded.counters, None)
            .expect("finish");

        let (replayed, ending) = load(&raw).expect("replay");
        assert_eq!(ending, Ending::Finished);
        assert_eq!(replayed, recorded);
        assert_eq!(
            jsonl::render(&replayed.timelines),
            jsonl::render(&recorded.timelines)
        );
        assert_eq!(replayed.timelines.len(), 3);
        assert!(replayed.timelines[2].aborted);

        // a file cut inside its last record still replays what it holds
        let bytes = std::fs::read(&raw).expect("read");
        let cut = dir.join("cut.pb");
        std::fs::write(&cut, &bytes[..bytes.len() - 2]).expect("write");
        let (partial, ending) = load(&cut).expect("partial replay");
        assert!(matches!(ending, Ending::Truncated(_)));
        assert_eq!(partial.timelines.len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
