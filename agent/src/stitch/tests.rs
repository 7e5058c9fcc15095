//! Stitcher-level tests: hand-built events in, timelines out.
