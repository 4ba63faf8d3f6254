//! What a run reports: one record per transfer and a summary, as a table or one JSON object.

use std::time::Duration;

use gradwire_experiment::quantile;
use gradwire_units::human_size;
use serde::Serialize;

/// One tensor transfer.
#[derive(Debug, Clone, Serialize)]
pub struct Xfer {
    pub index: u32,
    pub segments: u32,
    pub received_segments: u32,
    pub delivered_fraction: f64,
    /// Retransmission rounds (passes after the first); `None` on a message-layer sender,
    /// which does not learn how many passes the receiver saw.
    pub rounds: Option<u32>,
    pub fct_us: f64,
    pub packets_sent: Option<u64>,
    pub retransmitted: Option<u64>,
    pub rate_halvings: Option<u64>,
    pub duplicates: Option<u64>,
    /// Data datagrams the receiver refused, by reason (receiver side only). On the message
    /// layer only `foreign_source` (peer binding) is counted here; the rest is `invalid`.
    pub rejected: Option<gradwire::flow::RejectCounts>,
    /// Message layer, receiver side: datagrams from the sender's address that the layer
    /// refused (malformed, another job, wrong ranks, out of range).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<u64>,
    /// Message layer, receiver side: what ended the message (`complete`, `loss bound`,
    /// `deadline`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended: Option<&'static str>,
    /// Every delivered byte equals the sender's byte (receiver side only).
    pub verified: Option<bool>,
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub role: &'static str,
    pub datapath: &'static str,
    /// `msg` (the message layer) or `flow` (the flow transport).
    pub protocol: &'static str,
    pub dtype: String,
    pub size_bytes: u64,
    pub count: u32,
    pub loss_bound: f64,
    pub inject_loss: f64,
    /// Smallest delivered fraction over the transfers.
    pub delivered_fraction: f64,
    pub delivered_fraction_mean: f64,
    /// Largest number of retransmission rounds of any transfer.
    pub rounds: u32,
    pub rounds_total: u64,
    /// Delivered payload bytes over the wall time of all transfers.
    pub goodput_gbps: f64,
    pub fct_p50_us: f64,
    pub fct_p99_us: f64,
    pub fct_mean_us: f64,
    pub elapsed_s: f64,
    /// Every delivered byte of every transfer matched (receiver side only).
    pub verified: Option<bool>,
    pub transfers: Vec<Xfer>,
    /// AF_XDP socket and XDP classifier counters of the sending end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afxdp_sender: Option<gradwire::afxdp::AfXdpStats>,
    /// ... and of the receiving end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afxdp_receiver: Option<gradwire::afxdp::AfXdpStats>,
    /// Message layer: the sending endpoint's counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_sender: Option<crate::stats::EndpointCounters>,
    /// ... and the receiving endpoint's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_receiver: Option<crate::stats::EndpointCounters>,
}

impl Summary {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        role: &'static str,
        datapath: &'static str,
        dtype: String,
        size_bytes: u64,
        loss_bound: f64,
        inject_loss: f64,
        delivered_bytes: u64,
        elapsed: Duration,
        transfers: Vec<Xfer>,
    ) -> Summary {
        let n = transfers.len().max(1) as f64;
        let mut fcts: Vec<f64> = transfers.iter().map(|x| x.fct_us).collect();
        fcts.sort_by(f64::total_cmp);
        let verified = if transfers.iter().any(|x| x.verified.is_some()) {
            Some(transfers.iter().all(|x| x.verified == Some(true)))
        } else {
            None
        };
        Summary {
            role,
            datapath,
            protocol: "flow",
            dtype,
            size_bytes,
            count: transfers.len() as u32,
            loss_bound,
            inject_loss,
            delivered_fraction: transfers
                .iter()
                .map(|x| x.delivered_fraction)
                .fold(1.0, f64::min),
            delivered_fraction_mean: transfers.iter().map(|x| x.delivered_fraction).sum::<f64>()
                / n,
            rounds: transfers.iter().filter_map(|x| x.rounds).max().unwrap_or(0),
            rounds_total: transfers
                .iter()
                .filter_map(|x| x.rounds)
                .map(u64::from)
                .sum(),
            goodput_gbps: if elapsed.is_zero() {
                0.0
            } else {
                delivered_bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9
            },
            fct_p50_us: quantile(&fcts, 0.50),
            fct_p99_us: quantile(&fcts, 0.99),
            fct_mean_us: fcts.iter().sum::<f64>() / n,
            elapsed_s: elapsed.as_secs_f64(),
            verified,
            transfers,
            afxdp_sender: None,
            afxdp_receiver: None,
            endpoint_sender: None,
            endpoint_receiver: None,
        }
    }

    pub fn print(&self, json: bool) {
        if json {
            match serde_json::to_string(self) {
                Ok(s) => println!("{s}"),
                Err(e) => eprintln!("gradwire: cannot encode JSON: {e}"),
            }
            return;
        }
        println!(
            "gradwire {}: {} x {} {} over {} ({}), loss bound {:.2}%, injected loss {:.2}%",
            self.role,
            self.count,
            human_size(self.size_bytes),
            self.dtype,
            self.datapath,
            match self.protocol {
                "msg" => "message layer",
                _ => "flow transport",
            },
            self.loss_bound * 100.0,
            self.inject_loss * 100.0
        );
        println!(
            "{:>4}  {:>10}  {:>9}  {:>6}  {:>10}  {:>9}  {:>8}  {:>8}",
            "#", "delivered", "segments", "rounds", "fct_ms", "retx_segs", "halvings", "verified"
        );
        for x in &self.transfers {
            println!(
                "{:>4}  {:>9.3}%  {:>9}  {:>6}  {:>10.2}  {:>9}  {:>8}  {:>8}",
                x.index,
                x.delivered_fraction * 100.0,
                x.segments,
                x.rounds.map_or_else(|| "-".into(), |r| r.to_string()),
                x.fct_us / 1e3,
                opt(x.retransmitted),
                opt(x.rate_halvings),
                x.verified.map_or("-", |v| if v { "yes" } else { "NO" }),
            );
        }
        println!(
            "summary: delivered min {:.3}% mean {:.3}%, rounds max {}, fct p50 {:.2} ms p99 {:.2} ms, goodput {:.2} Gbit/s over {:.2} s{}",
            self.delivered_fraction * 100.0,
            self.delivered_fraction_mean * 100.0,
            self.rounds,
            self.fct_p50_us / 1e3,
            self.fct_p99_us / 1e3,
            self.goodput_gbps,
            self.elapsed_s,
            match self.verified {
                Some(true) => ", every delivered byte verified",
                Some(false) => ", VERIFICATION FAILED",
                None => "",
            }
        );
        let mut refused = gradwire::flow::RejectCounts::default();
        for r in self.transfers.iter().filter_map(|x| x.rejected.as_ref()) {
            refused.add(r);
        }
        let invalid: u64 = self.transfers.iter().filter_map(|x| x.invalid).sum();
        if refused.total() > 0 {
            println!("refused data datagrams: {refused}");
        }
        if invalid > 0 {
            println!("refused datagrams from the sender's address (malformed, another job, out of range): {invalid}");
        }
        for (who, e) in [
            ("sender", &self.endpoint_sender),
            ("receiver", &self.endpoint_receiver),
        ] {
            if let Some(e) = e {
                crate::stats::print_endpoint(who, e);
            }
        }
        for (who, st) in [
            ("sender", &self.afxdp_sender),
            ("receiver", &self.afxdp_receiver),
        ] {
            if let Some(st) = st {
                crate::stats::print_afxdp(who, st);
            }
        }
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        // The summary's p50/p99 are gradwire_experiment::quantile (q in 0..=1) and its sizes
        // gradwire_units::human_size: the workspace's one helper for each.
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.50), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
        assert_eq!(quantile(&[], 0.50), 0.0);
        assert_eq!(human_size(64 << 20), "64.0MiB");
        assert_eq!(human_size(1500), "1.5KiB");
    }

    #[test]
    fn summary_json_has_required_fields() {
        let x = Xfer {
            index: 1,
            segments: 10,
            received_segments: 9,
            delivered_fraction: 0.9,
            rounds: Some(1),
            fct_us: 100.0,
            packets_sent: Some(11),
            retransmitted: Some(1),
            rate_halvings: Some(0),
            duplicates: Some(0),
            rejected: Some(gradwire::flow::RejectCounts::default()),
            invalid: None,
            ended: None,
            verified: Some(true),
        };
        let s = Summary::new(
            "demo",
            "udp",
            "f32".into(),
            14400,
            0.1,
            0.1,
            12960,
            Duration::from_millis(1),
            vec![x],
        );
        let v: serde_json::Value = serde_json::to_value(&s).unwrap();
        for k in [
            "datapath",
            "size_bytes",
            "loss_bound",
            "delivered_fraction",
            "rounds",
            "goodput_gbps",
            "fct_p50_us",
            "fct_p99_us",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert!((s.goodput_gbps - 0.10368).abs() < 1e-9);
    }
}
