//! The report waterfall's row order: one request's hops one under the
//! other (the gateway's request, its upstream call, the engine's request
//! that answered it), joined by the trace ids the hop stage gave them, and
//! traces in the order their roots arrived.

use std::collections::{HashMap, HashSet};

use crate::model::RequestTimeline;

/// Indexes into `timelines` in waterfall order, each with its depth in its
/// trace (0: a root, or a line whose parent the session did not record).
pub fn hop_order(timelines: &[RequestTimeline]) -> Vec<(usize, usize)> {
    let by_span: HashMap<[u8; 8], usize> = timelines
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.trace.as_ref().map(|ids| (ids.span_id, i)))
        .collect();
    let mut children: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut roots = Vec::new();
    for (i, t) in timelines.iter().enumerate() {
        let parent = t
            .trace
            .as_ref()
            .and_then(|ids| ids.parent_span_id)
            .and_then(|p| by_span.get(&p).copied())
            .filter(|&p| p != i);
        match parent {
            Some(p) => children.entry(p).or_default().push(i),
            None => roots.push(i),
        }
    }
    let by_start = |list: &mut Vec<usize>| {
        list.sort_by_key(|&i| (timelines[i].request_start, i));
    };
    by_start(&mut roots);
    for list in children.values_mut() {
        by_start(list);
    }
    let mut out = Vec::with_capacity(timelines.len());
    let mut seen = HashSet::new();
    for root in roots {
        let mut stack = vec![(root, 0)];
        while let Some((i, depth)) = stack.pop() {
            if !seen.insert(i) {
                continue;
            }
            out.push((i, depth));
            if let Some(kids) = children.get(&i) {
                stack.extend(kids.iter().rev().map(|&k| (k, depth + 1)));
            }
        }
    }
    // lines in a cycle of parents (not made by the hop stage) still show
    for i in 0..timelines.len() {
        if seen.insert(i) {
            out.push((i, 0));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TraceIds;

    fn line(start: u64, span: u8, parent: Option<u8>) -> RequestTimeline {
        RequestTimeline {
            request_start: start,
            trace: Some(TraceIds {
                trace_id: [1; 16],
                span_id: [span; 8],
                parent_span_id: parent.map(|p| [p; 8]),
                parent_remote: false,
                flags: 1,
                tracestate: None,
                join_key: None,
            }),
            ..RequestTimeline::default()
        }
    }

    #[test]
    fn hops_come_under_their_parent_and_traces_by_their_roots_arrival() {
        let timelines = vec![
            line(130, 3, Some(2)), // engine, under the upstream call
            line(200, 9, None),    // a request on its own, later
            line(120, 2, Some(1)), // the gateway's upstream call
            line(100, 1, None),    // the gateway's request
            line(50, 7, Some(42)), // its parent was not recorded
        ];
        assert_eq!(
            hop_order(&timelines),
            vec![(4, 0), (3, 0), (2, 1), (0, 2), (1, 0)]
        );
    }

    #[test]
    fn lines_without_ids_keep_arrival_order() {
        let at = |request_start| RequestTimeline {
            request_start,
            ..RequestTimeline::default()
        };
        let (a, b) = (at(20), at(10));
        assert_eq!(hop_order(&[a, b]), vec![(1, 0), (0, 0)]);
    }
}
