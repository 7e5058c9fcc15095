//! `flame.svg`: the session's on-CPU profile as an interactive flame graph
//! (inferno, the Rust port of `flamegraph.pl`).
//!
//! Colours are hashed from frame names and the layout is deterministic, so
//! a replay renders byte-identical SVG. A session without samples still
//! gets a `flame.svg` that says why, so the artifact set never varies.

use inferno::flamegraph::{self, color::BasicPalette, color::Palette, Options};

use super::core::{Profile, RecordingMeta};

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A small SVG carrying one message, for sessions without samples.
fn placeholder(message: &str) -> Vec<u8> {
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\
         <rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"#f8f8f8\"/>\
         <text x=\"600\" y=\"35\" font-family=\"Verdana,sans-serif\" font-size=\"14\" text-anchor=\"middle\">{}</text></svg>\n",
        escape(message)
    )
    .into_bytes()
}

/// Renders the flame graph, or a placeholder that says why there is none.
pub fn render(profile: Option<&Profile>, meta: &RecordingMeta) -> Vec<u8> {
    let Some(profile) = profile else {
        return placeholder(if meta.profile_hz == 0 {
            "CPU profiling was off for this session (--profile-hz 0)"
        } else {
            "no CPU profile: sampling could not start (see the session's warnings)"
        });
    };
    if profile.samples.is_empty() {
        return placeholder("no on-CPU samples of the traced processes during this session");
    }
    let lines = profile.folded();
    let mut options = Options::default();
    options.title = format!(
        "On-CPU profile, {} samples at {} Hz",
        profile.samples.len(),
        profile.frequency_hz
    );
    options.subtitle = Some(meta.selector.clone());
    options.count_name = "samples".to_string();
    options.colors = Palette::Basic(BasicPalette::Hot);
    options.hash = true;
    options.deterministic = true;
    let mut svg = Vec::new();
    match flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg) {
        Ok(()) => svg,
        Err(err) => placeholder(&format!("the flame graph could not be rendered: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::{meta, recording};

    #[test]
    fn renders_frames_as_an_svg_and_the_same_twice() {
        let rec = recording();
        let svg = render(rec.profile.as_ref(), &rec.meta);
        let text = String::from_utf8(svg.clone()).expect("utf-8");
        assert!(text.contains("<svg"), "{text}");
        assert!(text.contains("hot_loop"), "leaf frame shown");
        assert!(text.contains("3 samples at 99 Hz"));
        assert_eq!(
            svg,
            render(rec.profile.as_ref(), &rec.meta),
            "deterministic"
        );
    }

    #[test]
    fn says_why_when_there_is_no_profile() {
        let mut m = meta();
        m.profile_hz = 0;
        let text = String::from_utf8(render(None, &m)).expect("utf-8");
        assert!(text.contains("profiling was off"));
        let empty = Profile::default();
        let text = String::from_utf8(render(Some(&empty), &meta())).expect("utf-8");
        assert!(text.contains("no on-CPU samples"));
    }
}
