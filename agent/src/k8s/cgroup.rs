//! Container id and pod uid of a process, from its `/proc/PID/cgroup`.
//!
//! Every container runtime puts a container's processes in a cgroup whose
//! last path component carries the 64-hex container id, and the kubelet puts
//! a pod's containers under a cgroup named after the pod uid. Only the
//! spelling differs:
//!
//! | runtime / driver                 | leaf component                      | pod component                          |
//! |----------------------------------|-------------------------------------|----------------------------------------|
//! | containerd, systemd driver       | `cri-containerd-<id>.scope`         | `kubepods-<qos>-pod<uid_with_underscores>.slice` |
//! | containerd, cgroupfs driver      | `<id>`                              | `pod<uid-with-dashes>`                 |
//! | containerd, systemd, v1 variant  | `…pod<uid>.slice:cri-containerd:<id>` | (same component)                     |
//! | CRI-O                            | `crio-<id>.scope` / `crio-<id>`     | as above                               |
//! | Docker / cri-dockerd             | `docker-<id>.scope` / `/docker/<id>`| as above                               |
//! | Podman                           | `libpod-<id>.scope`                 | —                                      |
//!
//! The path is parsed component by component from the leaf up, never by
//! prefix: a reader in its own cgroup namespace (the agent's pod, by
//! default on cgroup v2) sees other pods' paths relative to its own root,
//! e.g. `0::/../../kubepods-besteffort-pod….slice/cri-containerd-<id>.scope`.
//! CRI-O's `crio-conmon-<id>.scope` holds the container monitor, not the
//! container, and yields no container id (its pod uid is still found).

use std::path::Path;

/// What the cgroup path of one process says about its container and pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupIds {
    /// 64 lowercase hex digits, as in `containerStatuses[].containerID`
    /// without its `containerd://` (or `cri-o://`, `docker://`) scheme.
    pub container_id: Option<String>,
    /// The pod's `metadata.uid`, with dashes.
    pub pod_uid: Option<String>,
}

impl CgroupIds {
    pub fn is_empty(&self) -> bool {
        self.container_id.is_none() && self.pod_uid.is_none()
    }
}

/// Reads and parses `/proc/PID/cgroup` under `proc_root`. `None` when the
/// process is gone or the file is unreadable.
pub fn read(proc_root: &Path, pid: u32) -> Option<CgroupIds> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    Some(parse_proc_cgroup(&text))
}

/// Parses the text of `/proc/PID/cgroup`: one `hierarchy:controllers:path`
/// line on cgroup v2 (`0::/…`), one per hierarchy on v1 and hybrid hosts.
/// The first line whose path names a container wins (on hybrid hosts the
/// v2 line may be just `/`); a pod uid is taken from any line.
pub fn parse_proc_cgroup(text: &str) -> CgroupIds {
    let mut found = CgroupIds::default();
    for line in text.lines() {
        // The path may itself contain ':' (the systemd v1 variant), so
        // split off exactly two fields.
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(_), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let ids = parse_path(path);
        if found.pod_uid.is_none() {
            found.pod_uid = ids.pod_uid.clone();
        }
        if ids.container_id.is_some() {
            return CgroupIds {
                container_id: ids.container_id,
                pod_uid: ids.pod_uid.or(found.pod_uid),
            };
        }
    }
    found
}

/// Parses one cgroup path. The container id is the innermost component
/// that is one (a container may create cgroups of its own below its leaf).
pub fn parse_path(path: &str) -> CgroupIds {
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let container_id = components
        .iter()
        .rev()
        .find_map(|c| container_id_of_component(c));
    let pod_uid = components
        .iter()
        .rev()
        .find_map(|c| pod_uid_of_component(c));
    CgroupIds {
        container_id,
        pod_uid,
    }
}

/// Runtime prefixes of a container's systemd scope or cgroupfs directory.
const RUNTIME_PREFIXES: &[&str] = &["cri-containerd-", "crio-", "docker-", "libpod-"];

fn container_id_of_component(component: &str) -> Option<String> {
    // `kubepods-…-pod<uid>.slice:cri-containerd:<id>`: the id is last.
    let leaf = component.rsplit(':').next().unwrap_or(component);
    let leaf = leaf.strip_suffix(".scope").unwrap_or(leaf);
    let id = RUNTIME_PREFIXES
        .iter()
        .find_map(|p| leaf.strip_prefix(p))
        .unwrap_or(leaf);
    is_container_id(id).then(|| id.to_string())
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid_with_underscores>.slice`
/// (systemd; `-` is the slice hierarchy separator there, hence `_`).
fn pod_uid_of_component(component: &str) -> Option<String> {
    let name = component.split(':').next().unwrap_or(component);
    let name = name.strip_suffix(".slice").unwrap_or(name);
    let at = name.rfind("pod")?;
    let before = &name[..at];
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    let uid = name[at + 3..].replace('_', "-");
    is_uuid(&uid).then_some(uid)
}

fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1e2d4c5b6a79880796a5b4c3d2e1f00112233445566778899aabbccddeeff0";
    const UID: &str = "4c2b3e1d-2f7a-4e8b-9c1d-3f5a6b7c8d9e";
    const UID_SYSTEMD: &str = "4c2b3e1d_2f7a_4e8b_9c1d_3f5a6b7c8d9e";

    fn both() -> CgroupIds {
        CgroupIds {
            container_id: Some(ID.into()),
            pod_uid: Some(UID.into()),
        }
    }

    #[test]
    fn cgroup_v2_systemd_driver_containerd_crio_docker() {
        for (qos, runtime) in [
            ("burstable", "cri-containerd"),
            ("besteffort", "crio"),
            ("burstable", "docker"),
        ] {
            let text = format!(
                "0::/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{UID_SYSTEMD}.slice/{runtime}-{ID}.scope\n"
            );
            assert_eq!(parse_proc_cgroup(&text), both(), "{runtime}");
        }
        // Guaranteed QoS pods sit directly under kubepods.slice.
        let guaranteed =
            format!("0::/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/cri-containerd-{ID}.scope");
        assert_eq!(parse_proc_cgroup(&guaranteed), both());
        // kind and other nested kubelets add a kubelet.slice prefix.
        let kind = format!(
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/\
             kubelet-kubepods-besteffort-pod{UID_SYSTEMD}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(parse_proc_cgroup(&kind), both());
    }

    #[test]
    fn cgroup_v2_cgroupfs_driver_and_reader_in_own_cgroup_namespace() {
        assert_eq!(
            parse_proc_cgroup(&format!("0::/kubepods/burstable/pod{UID}/{ID}\n")),
            both()
        );
        // seen from a pod with a private cgroup namespace
        assert_eq!(
            parse_proc_cgroup(&format!(
                "0::/../../kubepods-besteffort-pod{UID_SYSTEMD}.slice/cri-containerd-{ID}.scope"
            )),
            both()
        );
        assert_eq!(
            parse_proc_cgroup(&format!("0::/../cri-containerd-{ID}.scope")),
            CgroupIds {
                container_id: Some(ID.into()),
                pod_uid: None
            }
        );
    }

    #[test]
    fn cgroup_v1_cgroupfs_and_systemd_drivers() {
        let cgroupfs = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/{ID}\n\
             11:hugetlb:/kubepods/besteffort/pod{UID}/{ID}\n\
             4:memory:/kubepods/besteffort/pod{UID}/{ID}\n\
             1:name=systemd:/kubepods/besteffort/pod{UID}/{ID}\n"
        );
        assert_eq!(parse_proc_cgroup(&cgroupfs), both());
        let crio_cgroupfs = format!("3:cpu,cpuacct:/kubepods/burstable/pod{UID}/crio-{ID}\n");
        assert_eq!(parse_proc_cgroup(&crio_cgroupfs), both());
        let systemd_docker = format!(
            "10:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/docker-{ID}.scope\n"
        );
        assert_eq!(parse_proc_cgroup(&systemd_docker), both());
        // containerd with the systemd driver on some v1 hosts
        let colon = format!(
            "1:name=systemd:/system.slice/containerd.service/kubepods-burstable-pod{UID_SYSTEMD}.slice:cri-containerd:{ID}\n"
        );
        assert_eq!(parse_proc_cgroup(&colon), both());
    }

    #[test]
    fn hybrid_host_takes_the_container_from_a_v1_line() {
        let text = format!(
            "12:memory:/kubepods/burstable/pod{UID}/{ID}\n\
             1:name=systemd:/kubepods/burstable/pod{UID}/{ID}\n\
             0::/\n"
        );
        assert_eq!(parse_proc_cgroup(&text), both());
        let v2_first = format!("0::/\n4:memory:/kubepods/burstable/pod{UID}/{ID}\n");
        assert_eq!(parse_proc_cgroup(&v2_first), both());
    }

    #[test]
    fn plain_docker_and_podman_hosts_have_no_pod() {
        let only_id = CgroupIds {
            container_id: Some(ID.into()),
            pod_uid: None,
        };
        for text in [
            format!("12:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n"),
            format!("0::/system.slice/docker-{ID}.scope\n"),
            format!("0::/docker/{ID}\n"),
            format!("0::/machine.slice/libpod-{ID}.scope/container\n"),
        ] {
            assert_eq!(parse_proc_cgroup(&text), only_id, "{text}");
        }
    }

    #[test]
    fn host_processes_conmon_and_garbage_yield_nothing_or_only_the_pod() {
        for text in [
            "0::/system.slice/sshd.service\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/\n",
            "",
            "garbage\n",
            "0::/kubepods/pod-not-a-uid/abc\n",
            "0::/docker/3F1E2D4C\n",
        ] {
            assert!(parse_proc_cgroup(text).is_empty(), "{text:?}");
        }
        let conmon = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/crio-conmon-{ID}.scope\n"
        );
        assert_eq!(
            parse_proc_cgroup(&conmon),
            CgroupIds {
                container_id: None,
                pod_uid: Some(UID.into())
            }
        );
        // uppercase hex is not a runtime container id
        assert!(parse_path(&format!("/docker/{}", ID.to_uppercase()))
            .container_id
            .is_none());
    }

    #[test]
    fn nested_cgroups_inside_a_container_still_name_it() {
        let text = format!("0::/kubepods/burstable/pod{UID}/{ID}/system.slice/nginx.service\n");
        assert_eq!(parse_proc_cgroup(&text), both());
    }

    #[test]
    fn reads_from_a_proc_tree() {
        let dir = std::env::temp_dir().join(format!("tokentrace-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("9")).expect("tmp dir");
        std::fs::write(
            dir.join("9/cgroup"),
            format!("0::/kubepods/burstable/pod{UID}/{ID}\n"),
        )
        .expect("write");
        assert_eq!(read(&dir, 9), Some(both()));
        assert_eq!(read(&dir, 10), None);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
