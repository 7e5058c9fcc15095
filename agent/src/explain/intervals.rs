//! Sets of time intervals: union, clipping and subtraction, to share a gap
//! between causes without counting any nanosecond twice.

use crate::event::MonoNs;

/// Disjoint, sorted, non-empty half-open intervals `[start, end)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Intervals(Vec<(MonoNs, MonoNs)>);

impl Intervals {
    /// The union of `spans` (any order, overlapping, empty ones ignored).
    pub fn union_of(spans: impl IntoIterator<Item = (MonoNs, MonoNs)>) -> Self {
        let mut spans: Vec<_> = spans.into_iter().filter(|(s, e)| e > s).collect();
        spans.sort_unstable();
        let mut merged: Vec<(MonoNs, MonoNs)> = Vec::with_capacity(spans.len());
        for (start, end) in spans {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Self(merged)
    }

    /// The parts inside `[start, end)`.
    pub fn clip(&self, start: MonoNs, end: MonoNs) -> Self {
        Self(
            self.0
                .iter()
                .map(|&(s, e)| (s.max(start), e.min(end)))
                .filter(|(s, e)| e > s)
                .collect(),
        )
    }

    /// The parts not covered by `other`.
    pub fn minus(&self, other: &Intervals) -> Self {
        let mut out = Vec::new();
        for &(mut start, end) in &self.0 {
            for &(os, oe) in &other.0 {
                if oe <= start || os >= end {
                    continue;
                }
                if os > start {
                    out.push((start, os));
                }
                start = start.max(oe);
                if start >= end {
                    break;
                }
            }
            if start < end {
                out.push((start, end));
            }
        }
        Self(out)
    }

    /// Total length in nanoseconds.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|(s, e)| e - s).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = &(MonoNs, MonoNs)> {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_merges_overlaps_and_touching_spans() {
        let u = Intervals::union_of([(10, 20), (5, 12), (30, 40), (40, 45), (50, 50)]);
        assert_eq!(u, Intervals(vec![(5, 20), (30, 45)]));
        assert_eq!(u.total(), 30);
    }

    #[test]
    fn clip_and_minus_never_count_twice() {
        let a = Intervals::union_of([(0, 100)]);
        let b = Intervals::union_of([(10, 20), (50, 150)]);
        assert_eq!(a.minus(&b), Intervals(vec![(0, 10), (20, 50)]));
        assert_eq!(b.clip(15, 60), Intervals(vec![(15, 20), (50, 60)]));
        let everything = Intervals::union_of([(0, 1000)]);
        assert_eq!(a.minus(&everything).total(), 0);
        assert_eq!(a.minus(&Intervals::default()), a);
    }
}
