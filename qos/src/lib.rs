//! The one definition of gradwire's traffic classes, shared by the data plane (which tags
//! packets) and the switch control (which configures switches and NICs to honour the tags).
//!
//! DLCP (§3.2.2, §4.2) needs three things to agree end to end:
//!
//! 1. **Layer -> priority.** The packets of the *x*-th of *L* layers get priority *x·P/L*
//!    (rounded down) of *P* data priorities, so layers spread evenly over the queues and the
//!    front (input-side) layers, needed first by the next forward pass, get the highest one.
//! 2. **Priority -> queue.** Switches serve the highest queue number first under strict
//!    priority (IEEE 802.1Q selection, followed by Spectrum, SONiC, Cumulus and DCB). Queue
//!    [`CONTROL_QUEUE`] (7) is reserved for control signals; data uses queues 0..=6 and
//!    data priority 0 (front layers) is queue 6.
//! 3. **Queue -> DSCP.** Packets carry their class in the DSCP field; switches classify on
//!    it. [`CONTROL_DSCP`] marks control traffic, [`DATA_DSCP`] one code point per data
//!    queue.
//!
//! Everything here is a pure function or a constant: no I/O, no allocation, no panics, so
//! both the per-packet path and the configuration generator can use it.
//!
//! # Why these code points
//!
//! | queue | DSCP | PHB | why |
//! |---|---|---|---|
//! | 7 | 48 | CS6 | control; the class commodity switches give their top queue, already used by the data plane's control channel |
//! | 6 | 46 | EF | front layers; EF is the conventional PHB for the most urgent traffic (class 6 is control's) |
//! | 5 | 40 | CS5 | class 5 |
//! | 4 | 34 | AF41 | class 4, low drop precedence |
//! | 3 | 26 | AF31 | class 3; also Onyx's documented default (26 -> priority 3) |
//! | 2 | 18 | AF21 | class 2 |
//! | 1 | 10 | AF11 | class 1 |
//! | 0 | 0 | DF (CS0) | back layers share the default class with unmarked traffic, which lands in queue 0 anyway |
//!
//! For queues 0..=5 the DSCP class (DSCP >> 3) equals the queue index, so a switch whose map
//! still follows class selectors puts them in the right queue even before it is configured.
//! Queue 6 cannot follow that rule because class 6 (CS6) is control; it gets EF instead.
#![forbid(unsafe_code)]

/// Number of egress queues (and 802.1p priorities) on every target.
pub const NUM_QUEUES: u8 = 8;

/// The queue reserved for control signals: the highest strict priority.
pub const CONTROL_QUEUE: u8 = 7;

/// Number of data queues (0..=6).
pub const NUM_DATA_QUEUES: u8 = 7;

/// The data queue of the highest data priority (front layers).
pub const FRONT_DATA_QUEUE: u8 = NUM_DATA_QUEUES - 1;

/// DSCP of control traffic: CS6.
pub const CONTROL_DSCP: u8 = 48;

/// Highest legal DSCP value (6 bits).
pub const MAX_DSCP: u8 = 63;

/// Default DSCP code point of each data queue, indexed by queue (0..=6).
pub const DATA_DSCP: [u8; NUM_DATA_QUEUES as usize] = [0, 10, 18, 26, 34, 40, 46];

/// The data priority (0 = highest, for the front layers) of layer `layer_index` of a model
/// with `num_layers` layers spread over `num_data_priorities` priorities: ⌊x·P/L⌋ (DLCP
/// §3.2.2).
///
/// With fewer layers than priorities (L < P) the layers spread out and some priorities stay
/// unused (L = 3, P = 7 gives 0, 2, 4); with more (L > P) consecutive layers share one.
/// The result is always below `P`. Out-of-range inputs saturate instead of panicking:
/// `num_data_priorities` is clamped to 1..=[`NUM_DATA_QUEUES`], a `layer_index` at or past
/// `num_layers` counts as the last layer, and `num_layers == 0` gives priority 0.
pub const fn layer_priority(layer_index: u32, num_layers: u32, num_data_priorities: u8) -> u8 {
    let p = clamp_priorities(num_data_priorities) as u64;
    if num_layers == 0 {
        return 0;
    }
    let x = if layer_index >= num_layers {
        num_layers - 1
    } else {
        layer_index
    } as u64;
    // x < L, so x·P/L < P <= 7: the cast cannot truncate.
    ((x * p) / num_layers as u64) as u8
}

/// The data queue of a data priority (priority 0 -> queue 6, ..., 6 -> queue 0). Priorities
/// past the last data priority saturate to queue 0; never returns [`CONTROL_QUEUE`].
pub const fn priority_to_queue(priority: u8) -> u8 {
    if priority >= NUM_DATA_QUEUES {
        0
    } else {
        FRONT_DATA_QUEUE - priority
    }
}

/// The data priority served by a data queue, or `None` for the control queue and
/// out-of-range indices.
pub const fn queue_to_priority(queue: u8) -> Option<u8> {
    if queue >= NUM_DATA_QUEUES {
        None
    } else {
        Some(FRONT_DATA_QUEUE - queue)
    }
}

/// The default DSCP of a queue (data queues from [`DATA_DSCP`], queue 7 is
/// [`CONTROL_DSCP`]); `None` past the last queue.
pub const fn queue_dscp(queue: u8) -> Option<u8> {
    if queue == CONTROL_QUEUE {
        Some(CONTROL_DSCP)
    } else if queue < NUM_DATA_QUEUES {
        Some(DATA_DSCP[queue as usize])
    } else {
        None
    }
}

/// The queue a default code point selects: the inverse of [`queue_dscp`]. `None` for code
/// points gradwire does not use.
pub const fn dscp_queue(dscp: u8) -> Option<u8> {
    if dscp == CONTROL_DSCP {
        return Some(CONTROL_QUEUE);
    }
    let mut q = 0;
    while q < NUM_DATA_QUEUES {
        if DATA_DSCP[q as usize] == dscp {
            return Some(q);
        }
        q += 1;
    }
    None
}

/// The DSCP of a data priority: `queue_dscp(priority_to_queue(priority))`.
pub const fn priority_dscp(priority: u8) -> u8 {
    DATA_DSCP[priority_to_queue(priority) as usize]
}

/// The DSCP the data plane puts on packets of layer `layer_index` of `num_layers`, using
/// all seven data priorities.
pub const fn layer_dscp(layer_index: u32, num_layers: u32) -> u8 {
    priority_dscp(layer_priority(layer_index, num_layers, NUM_DATA_QUEUES))
}

/// The data queue of layer `layer_index` of `num_layers`, using all seven data priorities.
pub const fn layer_queue(layer_index: u32, num_layers: u32) -> u8 {
    priority_to_queue(layer_priority(layer_index, num_layers, NUM_DATA_QUEUES))
}

const fn clamp_priorities(p: u8) -> u8 {
    if p == 0 {
        1
    } else if p > NUM_DATA_QUEUES {
        NUM_DATA_QUEUES
    } else {
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_formula_on_examples() {
        // L = 14 (BERT-base: embeddings, 12 encoders, pooler), P = 7: two layers per priority.
        let got: Vec<u8> = (0..14).map(|x| layer_priority(x, 14, 7)).collect();
        assert_eq!(got, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]);
        // L = 16 (VGG-16): ⌊7x/16⌋.
        let got: Vec<u8> = (0..16).map(|x| layer_priority(x, 16, 7)).collect();
        assert_eq!(got, [0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6]);
    }

    #[test]
    fn fewer_layers_than_priorities_spread_out() {
        let got: Vec<u8> = (0..3).map(|x| layer_priority(x, 3, 7)).collect();
        assert_eq!(got, [0, 2, 4]);
        assert_eq!(layer_priority(0, 1, 7), 0);
        let got: Vec<u8> = (0..7).map(|x| layer_priority(x, 7, 7)).collect();
        assert_eq!(got, [0, 1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn more_layers_than_priorities_use_every_priority() {
        for l in 7..400u32 {
            let mut seen = [false; 7];
            for x in 0..l {
                seen[layer_priority(x, l, 7) as usize] = true;
            }
            assert!(seen.iter().all(|s| *s), "L = {l}");
        }
    }

    #[test]
    fn every_layer_gets_a_valid_data_queue_and_never_control() {
        for l in 0..300u32 {
            for p in 0..=9u8 {
                for x in 0..l + 3 {
                    let prio = layer_priority(x, l, p);
                    assert!(prio < NUM_DATA_QUEUES, "x={x} L={l} P={p}");
                    assert!(prio < clamp_priorities(p));
                    let q = priority_to_queue(prio);
                    assert!(q < NUM_DATA_QUEUES);
                    assert_ne!(q, CONTROL_QUEUE);
                    assert_ne!(priority_dscp(prio), CONTROL_DSCP);
                }
            }
        }
    }

    #[test]
    fn earlier_layers_never_get_a_lower_priority() {
        for l in 1..300u32 {
            for p in 1..=7u8 {
                for x in 1..l {
                    // Priority 0 is the highest: the number may only grow with x.
                    assert!(layer_priority(x - 1, l, p) <= layer_priority(x, l, p));
                    assert!(layer_queue(x - 1, l) >= layer_queue(x, l));
                }
                assert_eq!(
                    layer_priority(0, l, p),
                    0,
                    "front layer gets the top priority"
                );
                assert_eq!(layer_queue(0, l), FRONT_DATA_QUEUE);
            }
        }
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        assert_eq!(layer_priority(u32::MAX, u32::MAX, u8::MAX), 6);
        assert_eq!(layer_priority(u32::MAX - 1, u32::MAX, 7), 6);
        assert_eq!(layer_priority(5, 0, 7), 0);
        assert_eq!(
            layer_priority(9, 3, 7),
            4,
            "past the end counts as the last layer"
        );
        assert_eq!(layer_priority(2, 3, 0), 0, "P = 0 acts as one priority");
    }

    #[test]
    fn priority_queue_dscp_round_trip() {
        for prio in 0..NUM_DATA_QUEUES {
            let q = priority_to_queue(prio);
            assert_eq!(queue_to_priority(q), Some(prio));
            let d = priority_dscp(prio);
            assert_eq!(dscp_queue(d), Some(q));
        }
        assert_eq!(queue_to_priority(CONTROL_QUEUE), None);
        assert_eq!(priority_to_queue(200), 0);
        assert_eq!(queue_dscp(CONTROL_QUEUE), Some(CONTROL_DSCP));
        assert_eq!(dscp_queue(CONTROL_DSCP), Some(CONTROL_QUEUE));
        assert_eq!(queue_dscp(8), None);
        assert_eq!(dscp_queue(63), None);
    }

    #[test]
    fn code_points_are_distinct_legal_and_class_aligned() {
        let mut all: Vec<u8> = DATA_DSCP.to_vec();
        all.push(CONTROL_DSCP);
        for (i, a) in all.iter().enumerate() {
            assert!(*a <= MAX_DSCP);
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        for q in 0..6u8 {
            assert_eq!(DATA_DSCP[q as usize] >> 3, q, "queue {q} class");
        }
        assert_eq!(DATA_DSCP[3], 26, "AF31, Onyx's default for priority 3");
        assert_eq!(layer_dscp(0, 54), 46);
        assert_eq!(layer_dscp(53, 54), 0);
    }
}
