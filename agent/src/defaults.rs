//! The default configuration, embedded in the binary: the one place its
//! values are written (agent/config/default.yaml, every key present).
//!
//! A user's file is laid over it key by key (mappings merge, anything else
//! replaces), so an omitted key keeps the embedded value and the config
//! types need no `serde(default)` of their own. It sits below every stage:
//! each section's `Default` (the export stage's, the k8s stage's, …) reads
//! its own part here without importing the `config` module that composes
//! them.

use std::sync::OnceLock;

use serde::de::DeserializeOwned;
use serde_yaml::{Mapping, Value};

/// The configuration compiled into the binary.
pub const DEFAULT_CONFIG: &str = include_str!("../config/default.yaml");

fn embedded() -> &'static Value {
    static EMBEDDED: OnceLock<Value> = OnceLock::new();
    EMBEDDED.get_or_init(|| {
        serde_yaml::from_str(DEFAULT_CONFIG).expect("the embedded default config is valid YAML")
    })
}

/// The embedded value at `path` (dot-separated keys; "" is the whole file).
fn at(path: &str) -> Value {
    path.split('.')
        .filter(|key| !key.is_empty())
        .try_fold(embedded(), |value, key| value.get(key))
        .cloned()
        .unwrap_or_else(|| panic!("the embedded default config has no {path:?}"))
}

/// The embedded default of the section at `path` (`"export.sampling"`).
///
/// # Panics
/// When the embedded file lacks that section or it does not fit `T`. The
/// file is a constant of the binary, and the config tests deserialize every
/// section of it, so this is a build defect, not a user error.
pub fn section<T: DeserializeOwned>(path: &str) -> T {
    serde_yaml::from_value(at(path)).unwrap_or_else(|err| {
        panic!("the embedded default config's {path:?} does not deserialize: {err}")
    })
}

/// Why a user's text did not fit over the default.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// Not YAML (the message has the line and column).
    #[error(transparent)]
    Syntax(#[from] serde_yaml::Error),
    /// A value of the wrong type or an unknown key (the message starts with
    /// its dotted path: the merged tree has no line numbers).
    #[error(transparent)]
    Value(#[from] serde_path_to_error::Error<serde_yaml::Error>),
}

/// `user` (YAML text, every key optional) laid over the embedded section at
/// `path`, deserialized. An empty text is the default itself.
pub fn section_with<T: DeserializeOwned>(path: &str, user: &str) -> Result<T, OverlayError> {
    let mut merged = at(path);
    let user: Value = serde_yaml::from_str(user)?;
    if !user.is_null() {
        overlay(&mut merged, user);
    }
    Ok(serde_path_to_error::deserialize(merged)?)
}

/// Mappings merge key by key; any other value (lists included) replaces.
fn overlay(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(base), Value::Mapping(over)) => overlay_mapping(base, over),
        (base, over) => *base = over,
    }
}

fn overlay_mapping(base: &mut Mapping, over: Mapping) {
    for (key, value) in over {
        match base.get_mut(&key) {
            Some(existing) => overlay(existing, value),
            None => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_merge_and_lists_replace() {
        let mut base: Value = serde_yaml::from_str("a: {x: 1, y: [1, 2]}\nb: 2\n").expect("yaml");
        let over: Value = serde_yaml::from_str("a: {y: [3]}\nc: 4\n").expect("yaml");
        overlay(&mut base, over);
        let want: Value = serde_yaml::from_str("a: {x: 1, y: [3]}\nb: 2\nc: 4\n").expect("yaml");
        assert_eq!(base, want);
    }

    #[test]
    #[should_panic(expected = "has no \"nosuch.section\"")]
    fn a_missing_embedded_section_is_a_build_defect() {
        let _: Value = section("nosuch.section");
    }
}
