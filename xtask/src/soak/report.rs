//! The soak's verdicts: each phase's numbers, pass or fail and why, as a
//! compact text report and as JSON.

use std::collections::HashSet;
use std::fmt::Write as _;

use serde_json::{json, Value};

use super::load::{trace_id, Sent};
use super::measure::{
    coverage, delivery_windows, pooled_slope_mib_per_hour, slope_mib_per_hour, Gap, Window,
};
use super::outage;
use super::sampler::Sample;
use super::{Restart, Run};
use tokentrace_testkit::otel::prom_sum;

/// How long before an outage a reported request may still miss it: the
/// agent's `batch_timeout` (500 ms) plus the export round trip, doubled.
const DELIVERY_MARGIN_S: f64 = 2.0;

/// Requests sent this long after a new agent or server was ready must all
/// be covered.
const SETTLE_S: f64 = 1.0;

/// Steady windows shorter than this are left out of the RSS slope: over a
/// few seconds, the allocator's page-sized moves read as huge slopes (a
/// 2-min smoke run: 1875 MiB/h from two windows of seconds). The default
/// 30-min soak's windows last 150-230 s.
const MIN_STEADY_S: f64 = 60.0;

/// The kill's coverage is judged from this long before it: long enough that
/// requests finished before the kill open the window (a stream lasts 0.7
/// s), short enough to leave out the previous phase's restart (10 s before).
const KILL_LOOKBACK_S: f64 = 5.0;

pub fn build(run: &Run) -> (Value, String, bool) {
    let covered: HashSet<u64> = run
        .a
        .reports
        .iter()
        .chain(&run.b.reports)
        .map(|r| r.rid)
        .collect();
    let mut text = String::new();
    let mut all_pass = true;
    let mut verdict = |text: &mut String, name: &str, pass: bool, line: String| {
        all_pass &= pass;
        let _ = writeln!(
            text,
            "{} {name}: {line}",
            if pass { "PASS" } else { "FAIL" }
        );
        pass
    };

    // the load and the host
    let main_s = run.main_end - run.load_start;
    let in_main = |t: f64| t >= run.load_start && t < run.main_end;
    let sent_main = run.sent.iter().filter(|s| in_main(s.sent)).count();
    let ok = run.sent.iter().filter(|s| s.ok).count();
    let mut durations: Vec<f64> = run
        .sent
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.done - s.sent)
        .collect();
    durations.sort_by(f64::total_cmp);
    let duration_p50 = durations.get(durations.len() / 2).copied();
    let loads: Vec<f64> = run.samples.iter().filter_map(|s| s.load1).collect();
    let load_mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let load_max = loads.iter().copied().fold(0.0, f64::max);
    let locked =
        run.samples.iter().filter(|s| s.lock_held).count() as f64 / run.samples.len().max(1) as f64;
    let _ = writeln!(
        text,
        "soak: {:.1} min main phase, {} requests sent ({:.0}/min), {ok} answered ok, {} failed (server restarts), stream p50 {} s; \
         host load1 mean {load_mean:.1} max {load_max:.1} on {} cores, root-tests lock held {:.0} % of the time",
        main_s / 60.0,
        run.sent.len(),
        sent_main as f64 / (main_s / 60.0),
        run.sent.len() - ok,
        fmt(duration_p50, 2),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        locked * 100.0
    );

    // 1a. RSS: the verdict is the slope while the load is steady and the
    // collector up, pooled over the delivery windows after the first outage
    // (each window its own level). The agent's bounded buffers (the export
    // queue above all) reach a new high-water mark when an outage's backlog
    // is the largest so far, and the allocator keeps what it got: RSS rises
    // in steps at outages, toward a plateau, and is flat in between (two
    // 30-min runs: +17-20 MiB in the first outage, +1-6 MiB at later ones,
    // then flat). A per-request leak shows inside the windows. The plain
    // fits (second half, after the first cycle, all samples) and the step
    // at each outage are reported too.
    let fit_from = run.load_start + main_s / 2.0;
    let after_first = if main_s >= 2.0 * run.opts.cycle_s {
        run.load_start + run.opts.cycle_s
    } else {
        run.load_start + main_s / 3.0
    };
    let rss: Vec<(f64, f64)> = run
        .samples
        .iter()
        .filter(|s| s.tag == "A" && s.t < run.main_end)
        .filter_map(|s| Some((s.t, s.rss_kib? as f64 / 1024.0)))
        .collect();
    let fit: Vec<(f64, f64)> = rss.iter().copied().filter(|s| s.0 >= fit_from).collect();
    let slope_half = slope_mib_per_hour(&fit);
    let slope_all = slope_mib_per_hour(&rss);
    let after: Vec<(f64, f64)> = rss.iter().copied().filter(|s| s.0 >= after_first).collect();
    let slope_after_first = slope_mib_per_hour(&after);
    let a_empty: Vec<f64> = run
        .samples
        .iter()
        .filter(|s| s.tag == "A" && s.queue_len == Some(0.0))
        .map(|s| s.t)
        .collect();
    let steady: Vec<Window> = delivery_windows(&run.ups, &a_empty, DELIVERY_MARGIN_S)
        .into_iter()
        .skip(1)
        .filter(|w| w.to - w.from >= MIN_STEADY_S)
        .collect();
    let slope = pooled_slope_mib_per_hour(&rss, &steady);
    let at = |t: f64| rss.iter().rev().find(|s| s.0 <= t).map(|s| s.1);
    let steps: Vec<Option<f64>> = run
        .outages
        .iter()
        .map(|&(down, up)| {
            let drained = a_empty.iter().copied().find(|&t| t >= up)?;
            Some(round(at(drained)? - at(down)?, 2))
        })
        .collect();
    let per_request_b = slope.map(|s| s * 1024.0 * 1024.0 / (f64::from(run.opts.rate) * 60.0));
    let mib = |v: Option<&(f64, f64)>| v.map(|s| s.1);
    let cpu: Vec<(f64, u64)> = run
        .samples
        .iter()
        .filter(|s| s.tag == "A" && s.t < run.main_end)
        .filter_map(|s| Some((s.t, s.cpu_ns?)))
        .collect();
    let cpu_percent = match (cpu.first(), cpu.last()) {
        (Some(a), Some(b)) if b.0 > a.0 => Some(crate::util::cpu_percent(b.1 - a.1, b.0 - a.0)),
        _ => None,
    };
    let rss_max = rss.iter().map(|s| s.1).fold(0.0, f64::max);
    let rss_pass = verdict(
        &mut text,
        "rss",
        slope.is_some_and(|s| s <= run.opts.max_slope),
        format!(
            "slope {} MiB/h while steady ({} windows after the first outage; bound {} MiB/h; {} B per request); steps at outages {:?} MiB; \
             plain fits: second half {} MiB/h, from {:.0} s {} MiB/h, all samples {} MiB/h; \
             RSS {:.1} -> {:.1} MiB, max {rss_max:.1}; agent CPU {} % of a core",
            fmt(slope, 2),
            steady.len(),
            run.opts.max_slope,
            fmt(per_request_b, 1),
            steps,
            fmt(slope_half, 2),
            after_first - run.load_start,
            fmt(slope_after_first, 2),
            fmt(slope_all, 2),
            mib(rss.first()).unwrap_or(0.0),
            mib(rss.last()).unwrap_or(0.0),
            fmt(cpu_percent, 1),
        ),
    );

    // 1b. delivery while the collector is up, drops counted
    let a_samples: Vec<&Sample> = run.samples.iter().filter(|s| s.tag == "A").collect();
    let empty: Vec<f64> = a_samples
        .iter()
        .filter(|s| s.queue_len == Some(0.0))
        .map(|s| s.t)
        .collect();
    let windows = delivery_windows(&run.ups, &empty, DELIVERY_MARGIN_S);
    let in_window = |t: f64| windows.iter().any(|w| t >= w.from && t < w.to);
    let checked: Vec<u64> = run
        .a
        .reports
        .iter()
        .filter(|r| in_window(r.at))
        .map(|r| r.rid)
        .collect();
    let missing: Vec<u64> = checked
        .iter()
        .copied()
        .filter(|rid| !run.seen.has_trace(&trace_id(run.salt, *rid)))
        .collect();
    let main_cov = coverage(
        &run.sent,
        &covered,
        run.load_start,
        run.restart_port.stop_at,
    );
    // the counters just before the kill (a sample's, if that scrape failed)
    let last_a = a_samples.iter().rev().find(|s| s.queue_len.is_some());
    let a_text = &run.kill.a_last;
    let counter = |f: fn(&Sample) -> f64, name: &str, with: &[&str]| {
        if a_text.is_empty() {
            last_a.map(|s| f(s)).unwrap_or(0.0)
        } else {
            prom_sum(a_text, name, with)
        }
    };
    let exported = counter(|s| s.exported, "tokentrace_spans_exported_total", &[]);
    let dropped_full = counter(
        |s| s.dropped_full,
        "tokentrace_spans_dropped_total",
        &["reason=\"queue_full\""],
    );
    let dropped_failed = counter(
        |s| s.dropped_failed,
        "tokentrace_spans_dropped_total",
        &["reason=\"export_failed\""],
    );
    let queued = counter(
        |s| s.queue_len.unwrap_or(0.0),
        "tokentrace_export_queue_length",
        &[],
    );
    let lost_kernel = counter(
        |s| s.lost_kernel,
        "tokentrace_events_lost_total",
        &["where=\"kernel\""],
    );
    let lost_agent = counter(
        |s| s.lost_agent,
        "tokentrace_events_lost_total",
        &["where=\"agent\""],
    );
    // 1c. each outage: drain time and drops (outage.rs)
    let outage_verdicts: Vec<(f64, f64, outage::Verdict)> = run
        .outages
        .iter()
        .enumerate()
        .map(|(i, &(down, up))| {
            let until = run
                .outages
                .get(i + 1)
                .map_or(run.main_end, |&(next_down, _)| next_down);
            let verdict = outage::Outage {
                down,
                up,
                until,
                reports: &run.a.reports,
                samples: &a_samples,
            }
            .judge(|rid| run.seen.arrived_at(&trace_id(run.salt, rid)));
            (down, up, verdict)
        })
        .collect();
    let outages: Vec<Value> = outage_verdicts
        .iter()
        .map(|(down, up, v)| v.json(down - run.load_start, up - run.load_start))
        .collect();
    let drains: Vec<String> = outage_verdicts
        .iter()
        .map(|(_, _, v)| fmt(v.drained_after_s, 2))
        .collect();
    let outage_failures: Vec<String> = outage_verdicts
        .iter()
        .enumerate()
        .flat_map(|(i, (_, _, v))| {
            v.failures
                .iter()
                .map(move |f| format!("outage {}: {f}", i + 1))
        })
        .collect();
    let outages_pass = verdict(
        &mut text,
        "outages",
        outage_failures.is_empty(),
        format!(
            "{} outages over {}; drained after {:?} s (bound {} s); spans dropped per outage (queue full/export failed) {:?}; \
             backlog arrived {:?}{}",
            outage_verdicts.len(),
            run.opts.protocol.name(),
            drains,
            outage::MAX_DRAIN_S,
            outage_verdicts
                .iter()
                .map(|(_, _, v)| format!("{:.0}/{:.0}", v.dropped_queue_full, v.dropped_export_failed))
                .collect::<Vec<_>>(),
            outage_verdicts
                .iter()
                .map(|(_, _, v)| format!("{}/{}", v.arrived, v.backlog))
                .collect::<Vec<_>>(),
            if outage_failures.is_empty() {
                String::new()
            } else {
                format!("; {}", outage_failures.join("; "))
            }
        ),
    );
    let export_pass = verdict(
        &mut text,
        "export",
        !checked.is_empty() && missing.is_empty() && main_cov.uncovered == 0,
        format!(
            "{} of {} requests reported while the collector was up reached it ({} windows; backlog drained after {:?} s); \
             {} of {} requests sent reported; agent counters: {:.0} spans exported, dropped {:.0} queue full + {:.0} export failed, \
             {:.0} requests queued at the kill; collector received {} spans; events lost: {:.0} kernel, {:.0} agent",
            checked.len() - missing.len(),
            checked.len(),
            windows.len(),
            drains,
            main_cov.checked - main_cov.uncovered,
            main_cov.checked,
            exported,
            dropped_full,
            dropped_failed,
            queued,
            run.kill.collector_spans,
            lost_kernel,
            lost_agent,
        ),
    );

    // 2. and 4. server restarts
    let (port_json, port_pass) = restart_verdict(run, &run.restart_port, &covered);
    let port_line = restart_line(&port_json);
    verdict(&mut text, "server restart (--port)", port_pass, port_line);
    let (exe_json, exe_pass) = restart_verdict(run, &run.restart_exe, &covered);
    let exe_line = restart_line(&exe_json);
    verdict(&mut text, "server restart (--exe)", exe_pass, exe_line);

    // 3. agent SIGKILL
    let k = &run.kill;
    // from the middle of the previous phase (its own misses stay out)
    let gap = coverage(
        &run.sent,
        &covered,
        k.at - KILL_LOOKBACK_S,
        run.restart_exe.stop_at,
    );
    let after_ready = coverage(
        &run.sent,
        &covered,
        run.b_ready_at + SETTLE_S,
        run.restart_exe.stop_at,
    );
    let kill_pass = verdict(
        &mut text,
        "agent SIGKILL",
        k.left.clean()
            && !k.held.progs.is_empty()
            && k.held.uprobe_links > 0
            && gap.covered_inside == 0
            && gap.gap_ms.is_some()
            && after_ready.uncovered == 0,
        format!(
            "held {} programs, {} links ({} uprobes); reaped {:.0} ms after SIGKILL; left after {:.0} ms: {} programs, {} links, {} perf events, {} uprobe_events \
             ({} other BPF programs on the host); restarted agent ready {:.0} ms after the kill; coverage gap {} ms \
             ({} requests unseen{}), {} unseen after ready + {SETTLE_S} s",
            k.held.progs.len(),
            k.held.links.len(),
            k.held.uprobe_links,
            (run.a.reaped_at - k.at) * 1000.0,
            k.left.after_ms,
            k.left.progs.len(),
            k.left.links.len(),
            k.left.perf_entries,
            k.left.uprobe_events.len(),
            k.left.other_progs,
            (run.b_ready_at - k.at) * 1000.0,
            fmt(gap.gap_ms, 0),
            gap.uncovered,
            if gap.covered_inside > 0 {
                format!(", {} seen inside the gap: not one interruption", gap.covered_inside)
            } else {
                String::new()
            },
            after_ready.uncovered,
        ),
    );

    let summary_b = run.b.log.iter().rev().find_map(|(_, l)| {
        serde_json::from_str::<Value>(l)
            .ok()?
            .get("tokentrace_summary")
            .cloned()
    });
    let _ = writeln!(
        text,
        "{}: agent binary {}",
        if all_pass { "PASS" } else { "FAIL" },
        run.agent_bin.display()
    );
    let json = json!({
        "pass": all_pass,
        "options": {"minutes": run.opts.minutes, "rate_per_min": run.opts.rate, "cycle_s": run.opts.cycle_s,
                    "down_s": run.opts.down_s, "tokens": run.opts.tokens, "max_slope_mib_per_h": run.opts.max_slope,
                    "protocol": run.opts.protocol.name()},
        "agent_binary": run.agent_bin.display().to_string(),
        "load": {"sent": run.sent.len(), "ok": ok, "failed": run.sent.len() - ok,
                 "achieved_per_min": sent_main as f64 / (main_s / 60.0), "stream_p50_s": duration_p50,
                 "soak_total_s": run.end},
        "host": {"load1_mean": load_mean, "load1_max": load_max, "root_tests_lock_held_fraction": locked,
                 "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)},
        "rss": {"pass": rss_pass, "slope_mib_per_hour": slope, "slope_all_samples_mib_per_hour": slope_all,
                "slope_after_first_cycle_mib_per_hour": slope_after_first, "after_first_cycle_from_s": after_first - run.load_start,
                "steady_windows": steady.len(), "steps_at_outages_mib": steps,
                "slope_second_half_mib_per_hour": slope_half, "second_half_from_s": fit_from - run.load_start, "bytes_per_request": per_request_b,
                "agent_cpu_percent": cpu_percent, "first_mib": mib(rss.first()), "last_mib": mib(rss.last()), "max_mib": rss_max,
                "series_mib": rss.iter().step_by(10).map(|s| [round(s.0 - run.load_start, 0), round(s.1, 2)]).collect::<Vec<_>>()},
        "export": {"pass": export_pass, "checked_requests": checked.len(), "missing_requests": missing.len(),
                   "missing_rids": missing.iter().take(20).collect::<Vec<_>>(),
                   "windows": windows.iter().map(|w| [w.from - run.load_start, w.to - run.load_start]).collect::<Vec<_>>(),
                   "requests_sent": main_cov.checked, "requests_unreported": main_cov.uncovered,
                   "spans_exported": exported, "spans_dropped_queue_full": dropped_full,
                   "spans_dropped_export_failed": dropped_failed, "queued_requests_at_kill": queued,
                   "collector_spans_received": k.collector_spans,
                   "events_lost_kernel": lost_kernel, "events_lost_agent": lost_agent},
        "outages": {"pass": outages_pass, "max_drain_s": outage::MAX_DRAIN_S, "each": outages},
        "server_restart_port": port_json,
        "agent_kill": {"pass": kill_pass, "programs_held": k.held.progs.len(), "links_held": k.held.links.len(),
                       "uprobe_links_held": k.held.uprobe_links, "programs_left": k.left.progs, "links_left": k.left.links,
                       "perf_events_left": k.left.perf_entries, "uprobe_events_left": k.left.uprobe_events,
                       "clean_after_ms": k.left.after_ms, "other_bpf_programs": k.left.other_progs,
                       "restart_ready_after_kill_ms": (run.b_ready_at - k.at) * 1000.0,
                       "coverage": gap_json(&gap, k.at), "reaped_after_kill_ms": (run.a.reaped_at - k.at) * 1000.0, "unseen_after_ready": after_ready.uncovered,
                       "killed_agent_exit": run.a.exit},
        "server_restart_exe": exe_json,
        "agent_b_summary": summary_b,
    });
    (json, text, all_pass)
}

fn restart_verdict(run: &Run, r: &Restart, covered: &HashSet<u64>) -> (Value, bool) {
    let (pid, spawned, ready) = r.new;
    // requests still in flight when the phase ended are the next phase's
    let finished: Vec<Sent> = run
        .sent
        .iter()
        .filter(|s| s.done < r.phase_end)
        .cloned()
        .collect();
    let to_new = coverage(&finished, covered, spawned, r.phase_end);
    let late = coverage(&finished, covered, ready + SETTLE_S, r.phase_end);
    let first_covered = run
        .sent
        .iter()
        .filter(|s| s.ok && s.sent >= spawned && covered.contains(&s.rid))
        .map(|s| s.sent)
        .next();
    let from_new_pid = run
        .a
        .reports
        .iter()
        .chain(&run.b.reports)
        .filter(|rep| rep.pid == pid && rep.at >= spawned && rep.at < r.phase_end)
        .count();
    let pass =
        r.traced_at.is_some() && late.uncovered == 0 && to_new.checked > 0 && from_new_pid > 0;
    let ms = |t: Option<f64>, from: f64| t.map(|t| round((t - from) * 1000.0, 1));
    (
        json!({"pass": pass, "old_pid": r.old_pid, "new_pid": pid,
               "ready_after_spawn_ms": ms(Some(ready), spawned),
               "traced_after_spawn_ms": ms(r.traced_at, spawned),
               "traced_after_ready_ms": ms(r.traced_at, ready),
               "first_covered_request_after_ready_ms": ms(first_covered, ready),
               "requests_to_new_server": to_new.checked, "reports_with_new_pid": from_new_pid, "unseen": to_new.uncovered,
               "unseen_after_ready_plus_settle": late.uncovered,
               "unseen_sent_after_ready_s": to_new.unseen_at.iter().map(|t| round(t - ready, 3)).collect::<Vec<_>>()}),
        pass,
    )
}

fn restart_line(v: &Value) -> String {
    format!(
        "pid {} -> {} (listening {} ms after spawn); traced {} ms after spawn ({} ms after listening); \
         first seen request sent {} ms after listening; {} of {} requests to the new server unseen ({} after +{SETTLE_S} s); {} reports name the new pid",
        v["old_pid"],
        v["new_pid"],
        v["ready_after_spawn_ms"],
        v["traced_after_spawn_ms"],
        v["traced_after_ready_ms"],
        v["first_covered_request_after_ready_ms"],
        v["unseen"],
        v["requests_to_new_server"],
        v["unseen_after_ready_plus_settle"],
        v["reports_with_new_pid"],
    )
}

fn gap_json(g: &Gap, origin: f64) -> Value {
    json!({"checked": g.checked, "unseen": g.uncovered, "gap_ms": g.gap_ms,
           "covered_inside_gap": g.covered_inside,
           "unseen_sent_s": g.unseen_at.iter().map(|t| round(t - origin, 3)).collect::<Vec<_>>()})
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}
