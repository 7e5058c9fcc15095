//! Where triggered sessions go, and the bound on their total size.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::session::SessionHub;

/// A new session directory under `root`: `<unix ms>-<rule>`, so names
/// sort oldest first.
pub fn session_dir(root: &Path, rule: &str) -> PathBuf {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let safe: String = rule
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    root.join(format!("{ms:013}-{safe}"))
}

/// Bytes of the regular files under `dir` (links are not followed).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Deletes the oldest finished sessions under `root` (also those of earlier
/// runs) until their total is at most `max_bytes`. Running sessions are
/// never deleted, so a bound smaller than one session is exceeded by that
/// session alone while it runs.
pub fn prune(root: &Path, max_bytes: u64, hub: &SessionHub) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut dirs: Vec<(PathBuf, u64)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| (e.path(), dir_bytes(&e.path())))
        .collect();
    dirs.sort();
    let mut total: u64 = dirs.iter().map(|(_, b)| b).sum();
    let running = hub.running_dirs();
    for (dir, bytes) in dirs {
        if total <= max_bytes {
            break;
        }
        if running.contains(&dir) {
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                total = total.saturating_sub(bytes);
                hub.forget_dir(&dir);
                tracing::info!(
                    "triggers: removed {} ({bytes} bytes) to stay within the size bound",
                    dir.display()
                );
            }
            Err(err) => tracing::warn!("triggers: removing {}: {err}", dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_by_time_and_rules_cannot_escape() {
        let root = Path::new("/r");
        let d = session_dir(root, "../../etc x");
        assert_eq!(d.parent(), Some(root));
        let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert!(name.ends_with("-______etc_x"), "{name}");
        assert_eq!(name.find('-'), Some(13), "{name}");
    }
}
