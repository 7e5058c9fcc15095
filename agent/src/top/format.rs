//! How numbers read on the live view: milliseconds to one decimal below
//! 100, whole above; rates with a k suffix past 10,000.

pub fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".to_string(),
        Some(v) if v < 100.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.0}"),
    }
}

pub fn rate(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

pub fn bytes(n: u64) -> String {
    let mib = n as f64 / f64::from(1u32 << 20);
    if mib >= 10.0 {
        format!("{mib:.0} MiB")
    } else {
        format!("{mib:.1} MiB")
    }
}

/// Each cause's share, largest first: `off_cpu 80% socket 20%` (shares
/// that round to 0% left out).
pub fn shares(shares: &[(String, f64)]) -> String {
    let shown: Vec<&(String, f64)> = shares.iter().filter(|(_, s)| *s >= 0.005).collect();
    if shown.is_empty() {
        return "-".to_string();
    }
    shown
        .into_iter()
        .map(|(cause, share)| format!("{cause} {:.0}%", share * 100.0))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Seconds ago, from the agent's clock.
pub fn ago(now_ns: u64, then_ns: u64) -> String {
    format!("{:.0}s", now_ns.saturating_sub(then_ns) as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_at_a_glance() {
        assert_eq!(ms(Some(52.34)), "52.3");
        assert_eq!(ms(Some(183.6)), "184");
        assert_eq!(ms(None), "-");
        assert_eq!(rate(2051.0), "2051");
        assert_eq!(rate(12_345.0), "12.3k");
        assert_eq!(rate(3.26), "3.3");
        assert_eq!(
            shares(&[
                ("off_cpu".into(), 0.8),
                ("socket".into(), 0.2),
                ("unexplained".into(), 0.001)
            ]),
            "off_cpu 80% socket 20%"
        );
    }
}
