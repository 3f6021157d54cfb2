//! The cluster key: only its holders are served, and a caller is the name it proved.

use super::*;

// ----- the cluster key -----

#[test]
fn with_a_cluster_key_only_holders_of_it_are_served() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(7);
    let p = agent("p-keyed", keyed(Some(&key)));
    regions(&p, &[4096], &mut rng);

    // A member with the key reads.
    let d = agent("d-keyed", keyed(Some(&key)));
    pair(&p, &d);
    assert_eq!(try_read(&d, &p, 4096), XferStatus::Done);
    assert_eq!(p.refused_connections(), 0);

    // No key, or another key: refused at the handshake, counted, nothing served.
    let outsider = agent("d-nokey", keyed(None));
    outsider.load_remote(&p.local_metadata().unwrap()).unwrap();
    assert!(matches!(
        try_read(&outsider, &p, 4096),
        XferStatus::Failed(_)
    ));
    let other = crate::auth::ClusterKey::generate().unwrap();
    let forger = agent("d-otherkey", keyed(Some(&other)));
    forger.load_remote(&p.local_metadata().unwrap()).unwrap();
    assert!(matches!(try_read(&forger, &p, 4096), XferStatus::Failed(_)));
    assert!(
        wait_for(Duration::from_secs(3), || (p.refused_connections() >= 2)
            .then_some(()))
        .is_some()
    );

    // The member is unaffected.
    assert_eq!(try_read(&d, &p, 4096), XferStatus::Done);
}

#[test]
fn a_caller_cannot_claim_a_name_it_did_not_prove() {
    let key = crate::auth::ClusterKey::generate().unwrap();
    let mut rng = Rng(8);
    let p = agent("p-named", keyed(Some(&key)));
    regions(&p, &[1024], &mut rng);
    // Proves "mallory" with the right key, then says hello as "d-victim".
    let addr = p.inner.local_addr;
    let s = std::net::TcpStream::connect(addr).unwrap();
    crate::auth::dial(
        &s,
        &key,
        "tcp",
        "mallory",
        "p-named",
        Duration::from_secs(2),
    )
    .unwrap();
    (&s).write_all(&wire::hello("d-victim", "p-named")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut head = [0u8; 6];
    (&s).read_exact(&mut head).unwrap();
    assert_eq!(&head[..4], &wire::ACK_MAGIC);
    assert_ne!(head[5], 0, "the hello under another name is refused");
    assert!(
        wait_for(Duration::from_secs(2), || (p.refused_connections() == 1)
            .then_some(()))
        .is_some()
    );
}
