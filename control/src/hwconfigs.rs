//! The ready-to-use configurations under `hw-configs/`, defined once here.
//!
//! Each file is the output of one `gradwire-ctl render` command line; the READMEs are
//! generated from the same table, so the command a README shows is the one that produced
//! the file. `scripts/gen-hw-configs.sh` writes them; a test regenerates them in memory and
//! fails if a checked-in file in one of these directories differs, is missing, or is not
//! generated. Other directories under `hw-configs/` (e.g. NIC tuning profiles) are not
//! this generator's.

use std::collections::BTreeMap;
use std::path::Path;

use crate::cli::{run, CliError};

/// One generated file.
#[derive(Debug)]
pub struct HwFile {
    /// File name inside the config's directory.
    pub name: &'static str,
    /// Arguments after `gradwire-ctl render`.
    pub args: &'static [&'static str],
}

/// One hardware role.
#[derive(Debug)]
pub struct HwConfig {
    /// Directory under `hw-configs/`.
    pub dir: &'static str,
    /// README title.
    pub title: &'static str,
    /// What it is for (Markdown).
    pub about: &'static str,
    /// Files.
    pub files: &'static [HwFile],
    /// How to apply it (Markdown).
    pub apply: &'static str,
}

const SN2100_SONIC_ARGS: [&str; 2] = ["--ports", "Ethernet0..60:4"];

/// Base threshold for ports at 100G and at 25G, with d = 0.5 for both: thresholds T to 4T.
/// The reference's DCTCP rule of thumb is about 3 KB per Gbit/s (~300 KB at 100G, ~75 KB
/// at 25G); 64 KiB..256 KiB and 16 KiB..64 KiB stay below it and keep the 4:1 ratio.
const BASE_100G: &str = "64KiB";
const BASE_25G: &str = "16KiB";

/// Every configuration.
pub const HW_CONFIGS: &[HwConfig] = &[
    HwConfig {
        dir: "sn2100-sonic",
        title: "NVIDIA SN2100 with SONiC",
        about: "Spectrum-1 switch (96-byte buffer cells), 16 x 100G ports named `Ethernet0`, \
`Ethernet4`, ..., `Ethernet60` (change `--ports` if yours differ). Thresholds T = 64 KiB, \
d = 0.5: queue 6 (front layers) 64 KiB up to queue 0 (back layers) 256 KiB, each rounded up \
to whole cells, in a 512 KiB per-port buffer. Queue 7 carries control (DSCP 48) with no \
early drop; every queue is strict priority; PFC is off on every queue (the patch removes \
`pfc_enable`, which a default Mellanox SONiC config sets to `3,4`). `qos-patch-25g.json` is \
the same policy for ports running at 25G: T = 16 KiB, d = 0.5 (16 to 64 KiB).",
        files: &[
            HwFile {
                name: "qos-config_db.json",
                args: &[
                    "--target",
                    "sonic",
                    "--base-threshold",
                    BASE_100G,
                    "--step",
                    "0.5",
                    "--asic",
                    "spectrum1",
                    SN2100_SONIC_ARGS[0],
                    SN2100_SONIC_ARGS[1],
                ],
            },
            HwFile {
                name: "qos-patch.json",
                args: &[
                    "--target",
                    "sonic-patch",
                    "--base-threshold",
                    BASE_100G,
                    "--step",
                    "0.5",
                    "--asic",
                    "spectrum1",
                    SN2100_SONIC_ARGS[0],
                    SN2100_SONIC_ARGS[1],
                ],
            },
            HwFile {
                name: "qos-patch-25g.json",
                args: &[
                    "--target",
                    "sonic-patch",
                    "--base-threshold",
                    BASE_25G,
                    "--step",
                    "0.5",
                    "--asic",
                    "spectrum1",
                    SN2100_SONIC_ARGS[0],
                    SN2100_SONIC_ARGS[1],
                ],
            },
        ],
        apply: "Preferred: `scripts/switch-apply.sh --target sonic --host admin@SWITCH -- \
--base-threshold 64KiB --step 0.5 --asic spectrum1 --ports Ethernet0..60:4` prints the \
commands and the field-by-field diff (dry run); add `--apply` to fetch the running config, \
build an exact patch and run `sudo config apply-patch` (YANG-validated, non-disruptive).\n\n\
By hand: copy `qos-patch.json` to the switch and run `sudo config apply-patch qos-patch.json`. \
This patch assumes the QoS tables and each port's `PORT_QOS_MAP` entry exist (they do after \
SONiC's default QoS config); otherwise render an exact one with \
`gradwire-ctl render --target sonic-patch --current running.json ...` where `running.json` \
comes from `sonic-cfggen -d --print-data` (the exact patch also removes `QUEUE|EthernetN|a-b` \
range entries such as `Ethernet0|3-4`, which this blind patch cannot see). \
`qos-config_db.json` is the same content as a config_db fragment (for `config load`, which \
merges without validation and removes nothing: neither a WRED profile already on queue 7 \
nor `pfc_enable`). Do not run `config qos reload` afterwards: it regenerates QoS from the \
platform templates and overwrites this.\n\n\
Lossless buffers: gradwire does not change `tc_to_pg_map`, `BUFFER_PG` or `BUFFER_QUEUE` \
(not in the reference it renders against). A default Mellanox SONiC config has lossless \
entries for priority groups and queues 3-4; `gradwire-ctl diff` and the dry run list the \
ones it finds. Move them to lossy profiles with your SONiC version's buffer tools.\n\n\
Persistence: `config apply-patch` changes the running CONFIG_DB only. The reference lists no \
command that saves it for the next boot, so `switch-apply.sh --save` refuses; save by hand \
with your SONiC version's documented command.",
    },
    HwConfig {
        dir: "sn2100-onyx",
        title: "NVIDIA SN2100 with Onyx",
        about: "Spectrum-1 switch (96-byte cells), interfaces `ethernet 1/1` to `1/16`. Same \
policy as the SONiC config: T = 64 KiB, d = 0.5, thresholds in whole KB (1024 B). Read the \
comments at the top of `qos.onyx` first: no documented Onyx command changes the DSCP -> \
priority map, and Onyx's default map sends DSCP 48 (control) to priority 6, not 7. Check \
and fix the map on the switch by hand before relying on this config. `qos-25g.onyx` is the \
same for ports running at 25G: T = 16 KiB, d = 0.5 (16 to 64 KB).",
        files: &[
            HwFile {
                name: "qos.onyx",
                args: &[
                    "--target",
                    "onyx",
                    "--base-threshold",
                    BASE_100G,
                    "--step",
                    "0.5",
                    "--asic",
                    "spectrum1",
                    "--ports",
                    "1/1..16",
                ],
            },
            HwFile {
                name: "qos-25g.onyx",
                args: &[
                    "--target",
                    "onyx",
                    "--base-threshold",
                    BASE_25G,
                    "--step",
                    "0.5",
                    "--asic",
                    "spectrum1",
                    "--ports",
                    "1/1..16",
                ],
            },
        ],
        apply: "`scripts/switch-apply.sh --target onyx --host admin@SWITCH --config \
hw-configs/sn2100-onyx/qos.onyx` shows what it would send (dry run); `--apply` sends the \
commands (comments stripped) over ssh in configuration mode. By hand: paste the non-comment \
lines in `configure terminal`. The reference lists no Onyx command that writes the running \
configuration for the next boot, so `--save` refuses; save by hand.",
    },
    HwConfig {
        dir: "cumulus-spectrum2",
        title: "Cumulus Linux switch (Spectrum-2, e.g. SN3700)",
        about: "Cumulus Linux with NVUE on a Spectrum-2 ASIC (144-byte cells). T = 64 KiB, \
d = 0.5, thresholds in bytes rounded up to whole cells. NVUE's `default-global` profiles \
apply to every port, so there is no port list. All 64 DSCPs are mapped explicitly.",
        files: &[HwFile {
            name: "qos.nvue",
            args: &[
                "--target",
                "nvue",
                "--base-threshold",
                BASE_100G,
                "--step",
                "0.5",
                "--asic",
                "spectrum2",
            ],
        }],
        apply: "`scripts/switch-apply.sh --target nvue --host cumulus@SWITCH --config \
hw-configs/cumulus-spectrum2/qos.nvue` (dry run; `--apply` runs it over ssh). By hand: \
`bash qos.nvue` on the switch; its last line, `nv config apply`, commits (the reference does \
not say whether that survives a reboot, and lists no save command). For a Spectrum-1 \
switch regenerate with `--asic spectrum1`.",
    },
    HwConfig {
        dir: "connectx-25g",
        title: "Hosts with ConnectX NICs at 25G",
        about: "Host side of the policy: trust DSCP, DSCP -> priority, priority -> traffic \
class, strict priority, PFC off on every priority. Two equivalent scripts: `mlnx-qos.sh` \
(NVIDIA `mlnx_qos`, from MLNX_OFED / mlnx-tools) and `dcb.sh` (iproute2 `dcb`, upstream \
drivers). They are byte-identical to the ones in `connectx-100g` on purpose: hosts do not \
mark or drop by threshold, so nothing on the NIC depends on link speed.\n\n\
What differs at 25G is the switch side: use T = 16 KiB, d = 0.5 (16 to 64 KiB, below the \
~3 KB per Gbit/s, ~75 KB at 25G, DCTCP rule of thumb). Ready-made: \
`../sn2100-sonic/qos-patch-25g.json` and `../sn2100-onyx/qos-25g.onyx`; for another switch, \
render with `gradwire-ctl render --target sonic-patch|onyx|nvue --base-threshold 16KiB \
--step 0.5 --asic ASIC --ports ...`.",
        files: &[
            HwFile {
                name: "mlnx-qos.sh",
                args: &["--target", "mlnx-qos"],
            },
            HwFile {
                name: "dcb.sh",
                args: &["--target", "dcb"],
            },
        ],
        apply: "As root on each host: `sh mlnx-qos.sh IFACE...` or `sh dcb.sh IFACE...` (for \
example `sh dcb.sh enp65s0f0np0`). Both are idempotent; run one of them, not both. The \
settings do not survive a reboot or driver reload: run the script from your provisioning.",
    },
    HwConfig {
        dir: "connectx-100g",
        title: "Hosts with ConnectX NICs at 100G",
        about: "Host side of the policy: trust DSCP, DSCP -> priority, priority -> traffic \
class, strict priority, PFC off on every priority. The scripts are byte-identical to the \
ones in `connectx-25g` on purpose (nothing on the NIC depends on link speed).\n\n\
What differs at 100G is the switch side: T = 64 KiB, d = 0.5 (64 to 256 KiB, below the \
~300 KB per-port DCTCP rule of thumb at 100G). Ready-made: `../sn2100-sonic/qos-patch.json` \
(or `qos-config_db.json`), `../sn2100-onyx/qos.onyx` and `../cumulus-spectrum2/qos.nvue`; \
for another switch, render with `gradwire-ctl render --target sonic-patch|onyx|nvue \
--base-threshold 64KiB --step 0.5 --asic ASIC --ports ...`.",
        files: &[
            HwFile {
                name: "mlnx-qos.sh",
                args: &["--target", "mlnx-qos"],
            },
            HwFile {
                name: "dcb.sh",
                args: &["--target", "dcb"],
            },
        ],
        apply: "As root on each host: `sh mlnx-qos.sh IFACE...` or `sh dcb.sh IFACE...`. \
Both are idempotent; run one of them, not both. Settings do not survive a reboot or driver \
reload.",
    },
];

fn readme(c: &HwConfig) -> String {
    let mut s = format!("# {}\n\n{}\n\n", c.title, c.about);
    s.push_str(
        "Generated by `scripts/gen-hw-configs.sh` from `control/src/hwconfigs.rs`; do not \
edit. A test regenerates every file and fails on any difference.\n\n| file | made by |\n|---|---|\n",
    );
    for f in c.files {
        s.push_str(&format!(
            "| `{}` | `gradwire-ctl render {}` |\n",
            f.name,
            f.args.join(" ")
        ));
    }
    s.push_str(&format!("\n## Applying\n\n{}\n", c.apply));
    s.push_str("\nSee `docs/switch-control.md` for the policy, units and rounding.\n");
    s
}

/// Every file, by path relative to `hw-configs/`.
pub fn generate() -> Result<BTreeMap<String, String>, CliError> {
    let mut out = BTreeMap::new();
    for c in HW_CONFIGS {
        for f in c.files {
            let mut args = vec!["gradwire-ctl", "render"];
            args.extend_from_slice(f.args);
            let mut buf = Vec::new();
            run(args, &mut buf)?;
            out.insert(
                format!("{}/{}", c.dir, f.name),
                String::from_utf8_lossy(&buf).into_owned(),
            );
        }
        out.insert(format!("{}/README.md", c.dir), readme(c));
    }
    Ok(out)
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// Differences between `dir` and the generated files: each entry names a file and whether
/// it is missing, different or not generated. Only the generated configs' directories are
/// searched for extra files; other directories under `hw-configs/` belong to other tools.
pub fn compare(dir: &Path, files: &BTreeMap<String, String>) -> Vec<String> {
    let mut stale = Vec::new();
    for (rel, text) in files {
        match std::fs::read_to_string(dir.join(rel)) {
            Ok(have) if &have == text => {}
            Ok(_) => stale.push(format!("{rel} differs")),
            Err(_) => stale.push(format!("{rel} missing")),
        }
    }
    let mut present = Vec::new();
    for c in HW_CONFIGS {
        walk(dir, &dir.join(c.dir), &mut present);
    }
    present.sort();
    for rel in present {
        if !files.contains_key(&rel) {
            stale.push(format!("{rel} is not generated"));
        }
    }
    stale
}
