//! Leaving parts of an opened BPF object out of its load: programs a run
//! does not need, and maps only those (or another run's choice) use.

use anyhow::{Context, Result};

/// Does not load the programs of `object` whose names `unwanted` picks.
pub(super) fn programs(object: &mut libbpf_rs::OpenObject, unwanted: impl Fn(&str) -> bool) {
    for mut program in object.progs_mut() {
        if unwanted(&program.name().to_string_lossy()) {
            program.set_autoload(false);
        }
    }
}

/// Does not create the maps of `object` whose names `unwanted` picks (no
/// kernel memory for them; code that uses them must be left out too, or be
/// dead for the verifier).
pub(super) fn maps(
    object: &mut libbpf_rs::OpenObject,
    unwanted: impl Fn(&str) -> bool,
) -> Result<()> {
    for mut map in object.maps_mut() {
        let name = map.name().to_string_lossy().into_owned();
        if unwanted(&name) {
            map.set_autocreate(false)
                .with_context(|| format!("leaving the {name} map out"))?;
        }
    }
    Ok(())
}
