//! The `tokentrace` binary: parses the command line, runs, and maps errors
//! to exit codes (1 = error, 2 = host cannot trace).

use std::process::ExitCode;

use clap::Parser;
use tokentrace::check::{kernel_release, probed_file_lines, program_lines, run_checks, Need};
use tokentrace::cli::{CheckArgs, Cli, Command};
use tracing_subscriber::EnvFilter;

fn init_logging(filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn check(args: &CheckArgs) -> ExitCode {
    println!(
        "tokentrace {} on Linux {}",
        env!("CARGO_PKG_VERSION"),
        kernel_release()
    );
    let lines = run_checks();
    for line in &lines {
        println!("{line}");
    }
    if let Some(pid) = args.pid {
        for line in probed_file_lines(pid) {
            println!("{line}");
        }
    }
    if args.programs {
        for line in program_lines() {
            println!("{line}");
        }
    }
    let blocking: Vec<_> = lines
        .iter()
        .filter(|l| !l.ok && l.need == Need::Required)
        .collect();
    if blocking.is_empty() {
        println!("tracing can work on this host");
        ExitCode::SUCCESS
    } else {
        let names: Vec<_> = blocking.iter().map(|l| l.name).collect();
        println!(
            "tracing cannot work on this host: missing {}",
            names.join(", ")
        );
        ExitCode::from(2)
    }
}

/// The async runtime of the commands that trace (two workers: the agent
/// should not compete with the servers it watches). The command's own
/// future runs on the main thread (`block_on`), its spawned tasks on the
/// workers.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|err| anyhow::anyhow!("starting the async runtime: {err}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_level);
    match cli.command {
        Command::Check(args) => check(&args),
        Command::Run(args) => {
            let json = args.output == tokentrace::output::OutputFormat::Json;
            let runtime = match runtime() {
                Ok(runtime) => runtime,
                Err(err) => {
                    eprintln!("Error: {err:#}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(tokentrace::run::run(args)) {
                Ok(summary) => {
                    eprintln!("{summary}");
                    if json {
                        eprintln!("{}", summary.to_json_line());
                    }
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("Error: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Record(args) => {
            match runtime().map(|rt| rt.block_on(tokentrace::record::record(*args))) {
                Ok(Ok(())) => ExitCode::SUCCESS,
                Ok(Err(err)) | Err(err) => {
                    eprintln!("Error: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Top(args) => match runtime().and_then(|rt| tokentrace::top::top(args, rt)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("Error: {err:#}");
                ExitCode::FAILURE
            }
        },
        Command::Replay(args) => match tokentrace::record::replay(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("Error: {err:#}");
                ExitCode::FAILURE
            }
        },
    }
}
