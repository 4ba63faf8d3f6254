use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use gradwire::testbed::{require_root, run_in_netns, spawn_in_netns};
use gradwire_control::render::fabric::FabricQos;
use gradwire_fabric::netns::FabricNet;
use gradwire_fabric::run::{spawn, FabricConfig};
use gradwire_fabric::topology::{default_policy, Topology};

#[test]
fn tcp_smoke() {
    if !require_root("tcp_smoke") {
        return;
    }
    let qos = FabricQos::from_policy(&default_policy()).unwrap();
    let topo = Topology::from_toml(
        "name = \"smk\"\n[defaults]\nrate = \"200Mbit\"\ndelay = \"20us\"\n[[switch]]\nname = \"s0\"\n[[host]]\nname = \"h\"\ncount = 2\nuplink = \"s0\"\n",
        qos,
    )
    .unwrap();
    let net = FabricNet::up(&topo).unwrap();
    let fab = spawn(&topo, net.switch_namespaces(), FabricConfig::default()).unwrap();
    let dst = topo.hosts[1].ip;
    let server = spawn_in_netns(net.host_ns(1).unwrap(), move || {
        let l = TcpListener::bind((dst, 5001)).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        v.len()
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    run_in_netns(net.host_ns(0).unwrap(), move || {
        let mut s =
            TcpStream::connect_timeout(&(dst, 5001).into(), Duration::from_secs(5)).unwrap();
        s.write_all(&vec![7u8; 5_000_000]).unwrap();
    })
    .unwrap();
    let n = server.join().unwrap();
    let el = t0.elapsed();
    let st = fab.stop().unwrap();
    eprintln!(
        "{n} bytes in {el:?} = {:.1} Mbit/s; lag {:?}",
        n as f64 * 8.0 / el.as_secs_f64() / 1e6,
        st.lag
    );
    eprintln!(
        "{}",
        serde_json::to_string(&st.switches[0].forward).unwrap()
    );
    assert_eq!(n, 5_000_000);
    drop(net);
}
