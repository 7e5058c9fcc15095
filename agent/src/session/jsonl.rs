//! `requests.jsonl`: one JSON object per request, the same object
//! `tokentrace run --output json` prints (one schema for users' scripts).

use crate::model::RequestTimeline;
use crate::output::JsonTimeline;

pub fn render(timelines: &[RequestTimeline]) -> String {
    let mut out = String::new();
    for timeline in timelines {
        out.push_str(&JsonTimeline::new(timeline).to_line());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::recording;

    #[test]
    fn one_json_object_per_request() {
        let rec = recording();
        let text = render(&rec.timelines);
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json line"))
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["chunks"], 4);
        assert_eq!(lines[0]["path"], "/v1/chat/completions?rid=0");
    }
}
