//! Command-line interface. Flags override the YAML config; every flag also
//! reads a `TOKENTRACE_*` environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::output::OutputFormat;
use crate::session::profile::DEFAULT_FREQUENCY_HZ;

#[derive(Debug, Parser)]
#[command(
    name = "tokentrace",
    version,
    about = "Per-request TTFT and inter-token latency of LLM inference servers, from eBPF probes",
    long_about = None
)]
pub struct Cli {
    /// Log level or filter (error, warn, info, debug, trace, or a RUST_LOG-style filter).
    #[arg(long, global = true, env = "TOKENTRACE_LOG", default_value = "warn")]
    pub log_level: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Report what this host supports for tracing; exits non-zero if tracing cannot work.
    Check(CheckArgs),
    /// Trace servers and print one timeline per finished request.
    Run(RunArgs),
    /// Record a session: report.html, trace.json, requests.csv/.jsonl and a
    /// CPU flame graph of the selected servers (locally, or on a remote agent).
    Record(Box<RecordArgs>),
    /// Rebuild a session's artifacts from its raw.pb.
    Replay(ReplayArgs),
    /// Live full-screen view: per service × model × route rates, TTFT/ITL
    /// percentiles and stall causes, the slowest recent requests, the
    /// agent's own line (traces here, or reads a running agent: --remote).
    Top(TopArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Also report the TLS libraries this process uses (what `run` would probe).
    #[arg(long)]
    pub pid: Option<u32>,

    /// Also load every probe program with the verifier's statistics on and
    /// list each one's stack depth and instruction count.
    #[arg(long)]
    pub programs: bool,
}

/// How the kernel side attaches: `run`'s and a local `record`'s.
#[derive(Debug, Clone, Default, Args)]
pub struct ProbeArgs {
    /// How uprobes are attached (overrides discovery.uprobe_mode): auto
    /// picks uprobe_multi links where the kernel has them (no
    /// CAP_SYS_ADMIN needed), else perf events, else tracefs.
    #[arg(long, value_enum, env = "TOKENTRACE_UPROBE_MODE")]
    pub uprobe_mode: Option<crate::probes::UprobeModeSetting>,

    /// Which hooks feed the data path (overrides capture.data_hooks): auto
    /// picks the socket layer's tracepoints where the kernel has them
    /// (Linux 6.3+; from 6.16 each send is dated at its start, before at
    /// its return), else the syscall hooks, which every syscall on the host
    /// pays for.
    #[arg(long, value_enum, env = "TOKENTRACE_DATA_HOOKS")]
    pub data_hooks: Option<crate::probes::DataHooksSetting>,

    /// Where the probes keep per-thread state (overrides
    /// capture.thread_state): auto picks task storage where the kernel
    /// offers it to tracing programs (Linux 6.4+), else hash maps by
    /// thread id, preallocated (~37 MiB of kernel memory).
    #[arg(long, value_enum, env = "TOKENTRACE_THREAD_STATE")]
    pub thread_state: Option<crate::probes::ThreadStateSetting>,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Trace this process (repeatable). Children it forks are traced too.
    #[arg(long, env = "TOKENTRACE_PID", value_delimiter = ',')]
    pub pid: Vec<u32>,

    /// Trace the processes listening on this TCP port (repeatable).
    #[arg(long, env = "TOKENTRACE_PORT", value_delimiter = ',')]
    pub port: Vec<u16>,

    /// Trace processes whose executable path or command line matches this regex.
    #[arg(long, env = "TOKENTRACE_EXE")]
    pub exe: Option<String>,

    /// Trace processes whose name (comm) matches this regex.
    #[arg(long, env = "TOKENTRACE_COMM")]
    pub comm: Option<String>,

    /// Output format.
    #[arg(long, value_enum, env = "TOKENTRACE_OUTPUT", default_value = "text")]
    pub output: OutputFormat,

    /// Stop after this many finished requests.
    #[arg(long, env = "TOKENTRACE_REQUESTS")]
    pub requests: Option<u64>,

    /// Stop after this long (e.g. 30s, 5m).
    #[arg(long, env = "TOKENTRACE_DURATION", value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,

    /// YAML config file (replaces the embedded default).
    #[arg(long, env = "TOKENTRACE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Payload bytes captured per syscall (overrides capture.bytes).
    #[arg(long, env = "TOKENTRACE_CAPTURE_BYTES")]
    pub capture_bytes: Option<u32>,

    /// Attach OpenSSL/CUDA/USDT uprobes once per library for every process
    /// on the host instead of per traced process (discovery.uprobes_all_processes).
    /// Costs every untraced process using those libraries a trap per call
    /// (~10 µs single-stepped, ~1 µs emulated): see README, "Cost model".
    #[arg(long, env = "TOKENTRACE_UPROBES_ALL_PROCESSES")]
    pub uprobes_all_processes: bool,

    #[command(flatten)]
    pub probes: ProbeArgs,

    /// Go on (and say ready) when probes the traced processes need cannot
    /// be attached (discovery.allow_degraded); the ready line lists them.
    #[arg(long, env = "TOKENTRACE_ALLOW_DEGRADED")]
    pub allow_degraded: bool,

    /// Kubernetes pod scope (replaces kubernetes.namespaces/selector;
    /// boxed to keep `Command` small).
    #[command(flatten)]
    pub k8s: Box<crate::k8s::K8sArgs>,

    /// OTLP and Prometheus export (boxed to keep `Command` small).
    #[command(flatten)]
    pub export: Box<crate::export::ExportArgs>,

    /// Session control endpoint (`tokentrace record --remote`).
    #[command(flatten)]
    pub control: Box<crate::session::ControlArgs>,
}

/// `tokentrace record`.
#[derive(Debug, Clone, Args)]
pub struct RecordArgs {
    /// Record this process (repeatable). Children it forks are included.
    #[arg(long, value_delimiter = ',')]
    pub pid: Vec<u32>,

    /// Record the processes listening on this TCP port (repeatable).
    #[arg(long, value_delimiter = ',')]
    pub port: Vec<u16>,

    /// Record processes whose executable path or command line matches this regex.
    #[arg(long)]
    pub exe: Option<String>,

    /// Record processes whose name (comm) matches this regex.
    #[arg(long)]
    pub comm: Option<String>,

    /// How long to record (e.g. 30s, 2m). Ctrl-C ends it early; the
    /// artifacts are written either way.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,

    /// Directory for report.html, trace.json, requests.csv/.jsonl, flame.svg
    /// (created if missing).
    #[arg(long)]
    pub out: PathBuf,

    /// CPU sampling frequency for the flame graph; 0 turns sampling off.
    #[arg(long, default_value_t = DEFAULT_FREQUENCY_HZ)]
    pub profile_hz: u64,

    /// Also write raw.pb, the raw event stream for `tokentrace replay`.
    /// It holds captured request and response bytes: share it with care.
    #[arg(long)]
    pub raw: bool,

    /// YAML config file (local recording).
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Payload bytes captured per syscall (local recording).
    #[arg(long)]
    pub capture_bytes: Option<u32>,

    /// `--uprobe-mode` and `--data-hooks`, as for `run` (local recording).
    #[command(flatten)]
    pub probes: ProbeArgs,

    /// Run the session on the agent serving this control endpoint
    /// (`tokentrace run` on that node), e.g. http://node-1:9465.
    #[arg(long)]
    pub remote: Option<String>,

    /// Bearer token for --remote, read from this file (else from
    /// TOKENTRACE_CONTROL_TOKEN, else from the local agent's root-only
    /// /var/lib/tokentrace/sessions/control.token).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

/// `tokentrace replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// A raw.pb written by `tokentrace record --raw`.
    pub raw: PathBuf,

    /// Directory for the rebuilt artifacts (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

/// `tokentrace top`.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Trace this process (repeatable). Children it forks are traced too.
    #[arg(long, value_delimiter = ',', conflicts_with = "remote")]
    pub pid: Vec<u32>,

    /// Trace the processes listening on this TCP port (repeatable).
    #[arg(long, value_delimiter = ',', conflicts_with = "remote")]
    pub port: Vec<u16>,

    /// Trace processes whose executable path or command line matches this regex.
    #[arg(long, conflicts_with = "remote")]
    pub exe: Option<String>,

    /// Trace processes whose name (comm) matches this regex.
    #[arg(long, conflicts_with = "remote")]
    pub comm: Option<String>,

    /// YAML config file (local tracing).
    #[arg(long, conflicts_with = "remote")]
    pub config: Option<PathBuf>,

    /// The sliding window the rows and the slowest list cover (at most 10m).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub window: Duration,

    /// Show the agent serving this control endpoint (`tokentrace run` on
    /// that node) instead of tracing here, e.g. http://node-1:9465.
    #[arg(long)]
    pub remote: Option<String>,

    /// Bearer token for --remote, read from this file (else from
    /// TOKENTRACE_CONTROL_TOKEN, else from the local agent's root-only
    /// /var/lib/tokentrace/sessions/control.token).
    #[arg(long, requires = "remote")]
    pub token_file: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::probes::{DataHooksSetting, ThreadStateSetting, UprobeModeSetting};

    #[test]
    fn run_and_record_take_the_same_probe_flags() {
        let flags = [
            "--data-hooks",
            "syscall",
            "--uprobe-mode",
            "tracefs",
            "--thread-state",
            "maps",
        ];
        let expected = (
            Some(DataHooksSetting::Syscall),
            Some(UprobeModeSetting::Tracefs),
            Some(ThreadStateSetting::Maps),
        );
        let run = Cli::try_parse_from(["tokentrace", "run", "--pid", "1"].into_iter().chain(flags))
            .expect("run parses");
        let Command::Run(run) = run.command else {
            panic!("not run");
        };
        let probes = |p: &ProbeArgs| (p.data_hooks, p.uprobe_mode, p.thread_state);
        assert_eq!(probes(&run.probes), expected);
        let record = Cli::try_parse_from(
            ["tokentrace", "record", "--pid", "1", "--out", "/tmp/x"]
                .into_iter()
                .chain(flags),
        )
        .expect("record parses");
        let Command::Record(record) = record.command else {
            panic!("not record");
        };
        assert_eq!(probes(&record.probes), expected);
    }
}
