//! Kept inference events of one kind, bounded and pruned as one queue
//! (oldest first, at most [`MAX_KEPT`]), and indexed by owner (a thread, a
//! socket, a process) so that explaining a request reads only its owners'
//! events, and of those only the ones that ended after the request began.
//!
//! An owner's events arrive in time order (a thread is switched back in,
//! or returns from a sync, after its previous one), so its lane is
//! binary-searched by end time; a lane that ever received an event ending
//! before its predecessor is scanned whole instead, so the answer never
//! depends on that order.

use std::collections::VecDeque;
use std::hash::Hash;

use foldhash::HashMap;

use crate::event::MonoNs;

/// Most events of one kind kept, whatever their age: a server doing
/// thousands of CUDA syncs a second must not make the history unbounded.
pub(super) const MAX_KEPT: usize = 100_000;

/// What a kept event is ordered, searched and pruned by.
pub(super) trait Ends {
    fn end(&self) -> MonoNs;
}

/// Events of one owner, oldest first, each with its arrival number.
#[derive(Debug)]
struct Lane<T> {
    items: VecDeque<(u64, T)>,
    /// Ends never decreased: `items` can be binary-searched by end.
    sorted: bool,
}

#[derive(Debug)]
pub(super) struct History<K, T> {
    /// The owner of every kept event, in arrival order.
    order: VecDeque<K>,
    lanes: HashMap<K, Lane<T>>,
    arrivals: u64,
}

impl<K: Hash + Eq + Copy, T: Ends> History<K, T> {
    pub(super) fn new() -> Self {
        Self {
            order: VecDeque::new(),
            lanes: HashMap::default(),
            arrivals: 0,
        }
    }

    /// Keeps `item` of `owner`, forgetting the oldest event when full.
    pub(super) fn push(&mut self, owner: K, item: T) {
        if self.order.len() >= MAX_KEPT {
            self.pop_oldest();
        }
        let lane = self.lanes.entry(owner).or_insert_with(|| Lane {
            items: VecDeque::new(),
            sorted: true,
        });
        if lane
            .items
            .back()
            .is_some_and(|(_, last)| last.end() > item.end())
        {
            lane.sorted = false;
        }
        lane.items.push_back((self.arrivals, item));
        self.arrivals += 1;
        self.order.push_back(owner);
    }

    /// Forgets the oldest events while the oldest ended before `cutoff`
    /// (a younger one behind an older one waits for it, as in one queue).
    pub(super) fn prune(&mut self, cutoff: MonoNs) {
        while let Some(owner) = self.order.front() {
            let oldest = self
                .lanes
                .get(owner)
                .and_then(|lane| lane.items.front())
                .map(|(_, item)| item.end());
            if oldest.is_some_and(|end| end >= cutoff) {
                break;
            }
            self.pop_oldest();
        }
    }

    /// `owner`'s events that may have ended after `after` (all of them
    /// when its lane is out of order), oldest first, with their arrival
    /// numbers.
    pub(super) fn ending_after(
        &self,
        owner: &K,
        after: MonoNs,
    ) -> impl Iterator<Item = &(u64, T)> + '_ {
        let items = self.lanes.get(owner).map(|lane| {
            let first = if lane.sorted {
                lane.items.partition_point(|(_, item)| item.end() <= after)
            } else {
                0
            };
            lane.items.range(first..)
        });
        items.into_iter().flatten()
    }

    /// Every kept event of `owner`, oldest first.
    pub(super) fn of(&self, owner: &K) -> impl Iterator<Item = &(u64, T)> + '_ {
        self.lanes
            .get(owner)
            .into_iter()
            .flat_map(|lane| lane.items.iter())
    }

    fn pop_oldest(&mut self) {
        let Some(owner) = self.order.pop_front() else {
            return;
        };
        if let Some(lane) = self.lanes.get_mut(&owner) {
            lane.items.pop_front();
            if lane.items.is_empty() {
                self.lanes.remove(&owner);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Ends for u64 {
        fn end(&self) -> MonoNs {
            *self
        }
    }

    fn ends(h: &History<u32, u64>, owner: u32, after: MonoNs) -> Vec<u64> {
        h.ending_after(&owner, after).map(|&(_, e)| e).collect()
    }

    #[test]
    fn lanes_are_searched_by_end_and_pruned_as_one_queue() {
        let mut h = History::new();
        for (owner, end) in [(1, 10), (2, 5), (1, 20), (2, 30), (1, 40)] {
            h.push(owner, end);
        }
        assert_eq!(ends(&h, 1, 15), vec![20, 40]);
        assert_eq!(ends(&h, 2, 0), vec![5, 30]);
        assert!(ends(&h, 3, 0).is_empty());
        // oldest first: (1,10) and (2,5) go, (1,20) stops the sweep
        h.prune(15);
        assert_eq!(ends(&h, 1, 0), vec![20, 40]);
        assert_eq!(ends(&h, 2, 0), vec![30]);
    }

    #[test]
    fn an_out_of_order_lane_is_scanned_whole() {
        let mut h = History::new();
        for end in [50, 10, 60] {
            h.push(7, end);
        }
        assert_eq!(ends(&h, 7, 40), vec![50, 10, 60]);
    }

    #[test]
    fn the_bound_forgets_the_oldest_of_any_owner() {
        let mut h = History::new();
        for i in 0..MAX_KEPT as u64 + 2 {
            h.push((i % 3) as u32, i);
        }
        assert_eq!(h.order.len(), MAX_KEPT);
        assert_eq!(ends(&h, 0, 0).first(), Some(&3));
        assert_eq!(ends(&h, 1, 0).first(), Some(&4));
        assert_eq!(ends(&h, 2, 0).first(), Some(&2));
    }
}
