//! Device regions: registered as VRAM with their device's context current, or refused
//! clearly; posts typed by one kind of memory a side.

use super::*;

/// A device region: its device's context is made current on the registering thread before
/// NIXL sees it, and NIXL registers it as VRAM, or (as here, where NIXL's UCX has no CUDA
/// device) refuses it with a message saying so, leaving nothing registered: the id takes a
/// host region afterwards. Registered, the agent's metadata names it as device memory.
#[test]
fn a_device_region_is_registered_as_vram_with_its_context_current_or_refused_clearly() {
    let Some(cfg) = nixl() else { return };
    let t = NixlTransport::open(&unique("gpu"), cfg).unwrap();
    let fake = crate::device::fake::FakeDevice::new(0);
    let region = Arc::new(fake.region(1 << 16, 4096));
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            let r = t.register(0, region.clone());
            (r, fake.is_current_here())
        })
        .join()
        .unwrap()
    });
    assert!(
        got.1,
        "the registering thread made the device's context current first"
    );
    assert!(!fake.is_current_here(), "and only that thread");
    match got.0 {
        Ok(()) => {
            let md = decode_md(&t.local_metadata().unwrap()).unwrap();
            assert_eq!(md.memory_of(0), MemoryKind::Cuda { device: 0 });
        }
        Err(TransportError::Io(e)) => {
            assert!(e.contains("as VRAM") && e.contains("CUDA device 0"), "{e}");
            t.register(0, Arc::new(KvRegion::new(4096, 4096))).unwrap();
            let md = decode_md(&t.local_metadata().unwrap()).unwrap();
            assert_eq!(md.devices, Vec::new());
        }
        Err(other) => panic!("unexpected refusal: {other:?}"),
    }
}

/// NIXL types a descriptor list as a whole: a post whose remote side spans host memory and a
/// peer's device memory is refused before NIXL sees it, and the agent posts on.
#[test]
fn a_post_across_two_kinds_of_memory_is_refused() {
    let Some(cfg) = nixl() else { return };
    let p = pair(&cfg, 8192, 4096);
    let mut body = decode_md(&p.b.local_metadata().unwrap()).unwrap();
    let &(_, addr, len, chunk) = &body.regions[0];
    body.regions.push((1, addr + len, len, chunk));
    body.devices = vec![(1, MemoryKind::Cuda { device: 0 })];
    p.a.load_remote(&encode_md(&body).unwrap()).unwrap();
    let mixed = [
        desc(0, 0, 4096),
        XferDesc {
            remote_region: 1,
            ..desc(4096, 0, 4096)
        },
    ];
    match p.a.post(XferOp::Read, p.b.name(), &mixed, None) {
        Err(TransportError::Io(e)) => {
            assert!(
                e.contains("host memory") && e.contains("CUDA device 0"),
                "{e}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let id =
        p.a.post(XferOp::Read, p.b.name(), &[desc(0, 0, 4096)], None)
            .unwrap();
    assert_eq!(wait(&*p.a, id), XferStatus::Done);
    p.a.release(id).unwrap();
}
