//! Properties of the MQTT sink's ledger: whatever the client and the
//! broker do (connections dropped, sessions kept or forgotten, packets
//! written again, acknowledgements for unknown packets), every result is
//! either published once or still held, and with a client that delivers
//! what it is handed, every result is published.

use proptest::prelude::*;
use rumqttc::QoS;
use tidegate_edge::sink::mqtt::{Ledger, Message};

#[derive(Debug, Clone)]
enum Op {
    Push(bool),
    Hand(usize),
    Written(u16),
    Acked(u16),
    Connected(bool),
    Disconnected,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        any::<bool>().prop_map(Op::Push),
        (1usize..8).prop_map(Op::Hand),
        (0u16..6).prop_map(Op::Written),
        (0u16..6).prop_map(Op::Acked),
        any::<bool>().prop_map(Op::Connected),
        Just(Op::Disconnected),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_result_is_published_at_most_once_or_still_held(
        qos1 in any::<bool>(),
        ops in prop::collection::vec(op(), 0..200),
    ) {
        let qos = if qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
        let mut l = Ledger::new(qos);
        let (mut pushed, mut published) = (0u64, 0u64);
        for op in ops {
            match op {
                Op::Push(result) => {
                    pushed += u64::from(result);
                    l.push(Message::new("t".into(), vec![1], false, result));
                }
                Op::Hand(window) => {
                    while l.next_to_hand(window).is_some() {}
                }
                Op::Written(pkid) => published += l.on_written(pkid).results,
                Op::Acked(pkid) => published += l.on_acked(pkid).results,
                Op::Connected(present) => l.on_connected(present),
                Op::Disconnected => l.on_disconnected(),
            }
            prop_assert_eq!(published + l.results_held() as u64, pushed);
        }
        let left = l.drain().results;
        prop_assert_eq!(published + left, pushed);
        prop_assert!(l.is_empty());
    }

    #[test]
    fn a_client_that_delivers_what_it_is_handed_gets_every_result_published(
        qos1 in any::<bool>(),
        n in 1usize..60,
        drops in prop::collection::vec(0usize..60, 0..5),
    ) {
        let qos = if qos1 { QoS::AtLeastOnce } else { QoS::AtMostOnce };
        let mut l = Ledger::new(qos);
        for _ in 0..n {
            l.push(Message::new("t".into(), vec![0], false, true));
        }
        l.on_connected(false);
        let mut published = 0u64;
        let mut pkid = 1u16;
        // Messages the client holds, handed and not yet written.
        let mut with_client = 0usize;
        for step in 0..n * 4 {
            if l.is_empty() {
                break;
            }
            while l.next_to_hand(4).is_some() {
                with_client += 1;
            }
            // It writes (and the broker acknowledges) half of what it
            // holds, at least one.
            let writes = with_client.div_ceil(2);
            for _ in 0..writes {
                let id = if qos1 { pkid } else { 0 };
                pkid = pkid.wrapping_add(1).max(1);
                published += l.on_written(id).results;
                if qos1 {
                    published += l.on_acked(id).results;
                }
            }
            with_client -= writes;
            // At the chosen steps the connection drops and comes back with
            // a new session: the client has dropped what it held, and the
            // ledger hands it all again.
            if drops.contains(&step) {
                l.on_disconnected();
                l.on_connected(false);
                with_client = 0;
            }
        }
        prop_assert!(l.is_empty(), "{} still held", l.len());
        prop_assert_eq!(published, n as u64);
    }
}
