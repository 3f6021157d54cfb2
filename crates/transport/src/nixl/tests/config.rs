//! The nixl backend's settings and library loading, and how posts are spread over UCX's
//! thread pool: no NIXL needed.

use super::*;

#[test]
fn backend_params_parse_and_replace_defaults_key_by_key() {
    assert_eq!(
        parse_backend_params(" num_threads=4 , split_batch_size=128,").unwrap(),
        vec![
            ("num_threads".to_string(), "4".to_string()),
            ("split_batch_size".to_string(), "128".to_string())
        ]
    );
    assert_eq!(parse_backend_params("").unwrap(), vec![]);
    for bad in ["num_threads", "=2", "a=1,b"] {
        let e = parse_backend_params(bad).unwrap_err();
        assert!(e.contains("key=value"), "{bad}: {e}");
    }

    // UCX's thread pool is on by default; a setting replaces its key and keeps the others.
    let mut cfg = NixlConfig::default();
    assert_eq!(cfg.backend, "UCX");
    assert!(cfg
        .backend_params
        .contains(&("num_threads".to_string(), "2".to_string())));
    cfg.set_backend_param("num_threads", "0");
    cfg.set_backend_param("ucx_error_handling_mode", "peer");
    let get = |k: &str| {
        cfg.backend_params
            .iter()
            .filter(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(get("num_threads"), ["0"]);
    assert_eq!(get("split_batch_size"), ["64"]);
    assert_eq!(get("ucx_error_handling_mode"), ["peer"]);
}

#[test]
fn nixl_open_with_bogus_path_is_unavailable_in_one_line() {
    let cfg = NixlConfig {
        lib_path: Some("/nonexistent/dir/libnixl_capi.so".into()),
        ..NixlConfig::default()
    };
    match NixlTransport::open("x", cfg) {
        Err(TransportError::Unavailable { backend, reason }) => {
            assert_eq!(backend, "nixl");
            assert!(!reason.contains('\n'), "{reason}");
            assert!(
                reason.contains("/nonexistent/dir/libnixl_capi.so"),
                "{reason}"
            );
            assert!(reason.contains("install-nixl"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }

    // A file with the right name that is not a shared library.
    let dir = std::env::temp_dir().join(unique("handoff-nixl-bogus"));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join(LIB_NAME);
    std::fs::write(&fake, b"not an ELF file\n").unwrap();
    let cfg = NixlConfig {
        lib_path: Some(fake.clone()),
        ..NixlConfig::default()
    };
    let r = NixlTransport::open("x", cfg);
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Err(TransportError::Unavailable { reason, .. }) => {
            assert!(!reason.contains('\n'), "{reason}");
            assert!(reason.contains("cannot load"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn nixl_config_defaults() {
    let c = NixlConfig::default();
    assert_eq!(c.progress_delay_us, 100);
    assert_eq!(c.backend, "UCX");
    assert!(c.lib_path.is_none());
    assert_eq!(c.backend_params.len(), UCX_DEFAULT_PARAMS.len());
}

#[test]
fn nixl_bad_backend_parameter_is_unavailable_and_names_the_parameter() {
    let Some(mut cfg) = nixl() else { return };
    cfg.set_backend_param("num_threads", "many");
    match NixlTransport::open(&unique("badparam"), cfg) {
        Err(TransportError::Unavailable { reason, .. }) => {
            assert!(!reason.contains('\n'), "{reason}");
            assert!(reason.contains("num_threads=many"), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn spread_follows_the_backend_parameters() {
    let cfg = |params: &[(&str, &str)]| NixlConfig {
        backend_params: params
            .iter()
            .map(|&(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..NixlConfig::default()
    };
    assert_eq!(
        Spread::of(&NixlConfig::default()),
        Some(Spread {
            threads: 2,
            batch: 64
        })
    );
    // NIXL's own split_batch_size default.
    assert_eq!(
        Spread::of(&cfg(&[("num_threads", "4")])),
        Some(Spread {
            threads: 4,
            batch: 1024
        })
    );
    // No pool, one thread, an unreadable value, another backend: nothing to spread over.
    assert_eq!(Spread::of(&cfg(&[])), None);
    assert_eq!(Spread::of(&cfg(&[("num_threads", "1")])), None);
    assert_eq!(Spread::of(&cfg(&[("num_threads", "two")])), None);
    let other = NixlConfig {
        backend: "GDS".into(),
        ..NixlConfig::default()
    };
    assert_eq!(Spread::of(&other), None);
}

#[test]
fn spread_cuts_cover_the_same_bytes_in_order() {
    let s = Spread {
        threads: 2,
        batch: 64,
    };
    // One 256 MiB run and a 3 MiB + 5 KiB one: cut into pieces of (total / 128) whole pages.
    let local = [(1 << 30, 256 << 20), (5 << 30, (3 << 20) + 5120)];
    let remote = [(7 << 30, 256 << 20), (9 << 30, (3 << 20) + 5120)];
    let (l, r) = s
        .cut(&local, &remote)
        .expect("few large descriptors are cut");
    assert!(l.len() >= s.wanted(), "{} pieces", l.len());
    assert_eq!(l.len(), r.len());
    let total: usize = local.iter().map(|d| d.1).sum();
    let piece = (total / s.wanted()) & !4095;
    assert!(piece >= MIN_SPREAD_PIECE);
    // Walking the pieces in order rebuilds every descriptor exactly, on both sides.
    let mut at = 0;
    for (&(la, len), &(ra, _)) in local.iter().zip(&remote) {
        let mut off = 0;
        while off < len {
            let (pl, pr) = (l[at], r[at]);
            assert_eq!(pl, (la + off, piece.min(len - off)));
            assert_eq!(pr, (ra + off, pl.1));
            off += pl.1;
            at += 1;
        }
    }
    assert_eq!(at, l.len());
    // Long enough already, or too little to be worth a second thread: left alone.
    let many: Vec<(usize, usize)> = (0..128).map(|i| (i << 24, 1 << 20)).collect();
    assert_eq!(s.cut(&many, &many), None);
    let small = [(0, (s.wanted() * MIN_SPREAD_PIECE) - 4096)];
    assert_eq!(s.cut(&small, &small), None);
    // A post a copy on the caller's thread finishes inside post_xfer_req stays there, though
    // its pieces would be long enough (a layer-wise stage).
    let stage = [(0, MIN_SPREAD_TOTAL - 4096)];
    assert!((MIN_SPREAD_TOTAL - 4096) / s.wanted() >= MIN_SPREAD_PIECE);
    assert_eq!(s.cut(&stage, &stage), None);
    assert_eq!(s.cut(&[], &[]), None);
}
