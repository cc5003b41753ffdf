//! A conformance suite that every [`Store`] implementation must pass.
//!
//! Stores in other crates (etcd, the embedded TCP store) run the same body in their tests, which
//! is what "plugs in unchanged" means. The suite returns an error describing the first violated
//! rule instead of panicking. It uses keys under `conformance/`; give it an empty namespace.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{CasOutcome, Store, StoreError};

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn ok<T>(r: Result<T, StoreError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Runs the whole suite against `store`. The store must be shareable across threads.
pub fn conformance<S: Store + 'static>(store: Arc<S>) -> Result<(), String> {
    let s = store.as_ref();
    // set / get / overwrite
    check(
        ok(s.get("conformance/none"), "get missing")?.is_none(),
        || "a missing key must read as None".into(),
    )?;
    ok(s.set("conformance/k", b"v1"), "set")?;
    ok(s.set("conformance/k", b"v2"), "overwrite")?;
    let got = ok(s.get("conformance/k"), "get")?;
    check(got.as_deref() == Some(&b"v2"[..]), || {
        format!("get after overwrite gave {got:?}")
    })?;
    ok(s.set("conformance/empty", b""), "set empty")?;
    let got = ok(s.get("conformance/empty"), "get empty")?;
    check(got.as_deref() == Some(&b""[..]), || {
        format!("an empty value must read back as empty, got {got:?}")
    })?;
    let bin: Vec<u8> = (0..=255u8).collect();
    ok(s.set("conformance/bin", &bin), "set binary")?;
    let got = ok(s.get("conformance/bin"), "get binary")?;
    check(got.as_deref() == Some(&bin[..]), || {
        "binary values must round-trip".into()
    })?;

    // add
    check(ok(s.add("conformance/n", 3), "add")? == 3, || {
        "add on a missing key starts at 0".into()
    })?;
    check(ok(s.add("conformance/n", -5), "add")? == -2, || {
        "add accumulates".into()
    })?;
    let got = ok(s.get("conformance/n"), "get counter")?;
    check(got.as_deref() == Some(&b"-2"[..]), || {
        format!("add stores decimal text, got {got:?}")
    })?;
    check(
        matches!(
            s.add("conformance/k", 1),
            Err(StoreError::InvalidValue { .. })
        ),
        || "add on a non-integer must be InvalidValue".into(),
    )?;

    // compare_and_set
    check(
        ok(
            s.compare_and_set("conformance/cas", None, b"a"),
            "cas absent",
        )? == CasOutcome::Swapped,
        || "cas(None) on an absent key must swap".into(),
    )?;
    let out = ok(
        s.compare_and_set("conformance/cas", None, b"b"),
        "cas present",
    )?;
    check(out == CasOutcome::Current(Some(b"a".to_vec())), || {
        format!("cas(None) on a present key must fail with the current value, got {out:?}")
    })?;
    let out = ok(
        s.compare_and_set("conformance/cas", Some(b"x"), b"b"),
        "cas wrong",
    )?;
    check(out == CasOutcome::Current(Some(b"a".to_vec())), || {
        format!("cas with a wrong expectation must not swap, got {out:?}")
    })?;
    check(
        ok(
            s.compare_and_set("conformance/cas", Some(b"a"), b"b"),
            "cas right",
        )? == CasOutcome::Swapped,
        || "cas with the right expectation must swap".into(),
    )?;
    let got = ok(s.get("conformance/cas"), "get cas")?;
    check(got.as_deref() == Some(&b"b"[..]), || {
        format!("after cas got {got:?}")
    })?;

    // wait: present keys, a timeout naming the missing key, and a key set by another thread.
    let got = ok(
        s.wait(&["conformance/k", "conformance/n"], Duration::from_secs(5)),
        "wait present",
    )?;
    check(got == vec![b"v2".to_vec(), b"-2".to_vec()], || {
        format!("wait returned {got:?}")
    })?;
    let t0 = Instant::now();
    match s.wait(
        &["conformance/k", "conformance/late"],
        Duration::from_millis(200),
    ) {
        Err(StoreError::Timeout { missing, .. }) => check(
            missing.len() == 1 && missing[0].ends_with("conformance/late"),
            || format!("timeout must name only the missing key, named {missing:?}"),
        )?,
        other => {
            return Err(format!(
                "wait on a missing key must time out, got {other:?}"
            ))
        }
    }
    check(t0.elapsed() < Duration::from_secs(3), || {
        format!("a 200 ms wait took {:?}", t0.elapsed())
    })?;
    let setter = {
        let store = store.clone();
        std::thread::spawn(move || {
            // Blocks until the waiter has announced itself, so the set happens after the wait
            // began (no sleep involved).
            let _ = store.wait(&["conformance/waiting"], Duration::from_secs(10));
            store.set("conformance/late", b"here")
        })
    };
    ok(s.set("conformance/waiting", b"1"), "set waiting")?;
    let got = ok(
        s.wait(&["conformance/late"], Duration::from_secs(10)),
        "wait for a key set by another thread",
    )?;
    check(got == vec![b"here".to_vec()], || format!("got {got:?}"))?;
    match setter.join() {
        Ok(r) => ok(r, "set from another thread")?,
        Err(_) => return Err("setter thread panicked".into()),
    }

    // concurrent adds are atomic
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    store.add("conformance/concurrent", 1)?;
                }
                Ok::<_, StoreError>(())
            })
        })
        .collect();
    for t in threads {
        match t.join() {
            Ok(r) => ok(r, "concurrent add")?,
            Err(_) => return Err("adder thread panicked".into()),
        }
    }
    let n = ok(s.add("conformance/concurrent", 0), "read counter")?;
    check(n == 100, || {
        format!("4 threads x 25 adds must give 100, got {n}")
    })?;

    // delete_prefix removes exactly the keys under the prefix
    ok(s.set("conformance/del/a", b"1"), "set")?;
    ok(s.set("conformance/del/b/c", b"1"), "set")?;
    ok(s.set("conformance/delx", b"1"), "set")?;
    let n = ok(s.delete_prefix("conformance/del/"), "delete_prefix")?;
    check(n == 2, || {
        format!("delete_prefix must delete 2 keys, said {n}")
    })?;
    check(
        ok(s.get("conformance/del/a"), "get")?.is_none()
            && ok(s.get("conformance/del/b/c"), "get")?.is_none(),
        || "deleted keys must be gone".into(),
    )?;
    check(ok(s.get("conformance/delx"), "get")?.is_some(), || {
        "delete_prefix must not touch keys outside the prefix".into()
    })?;
    let n = ok(s.delete_prefix("conformance/"), "delete all")?;
    check(n >= 9, || {
        format!("deleting the suite's keys removed only {n}")
    })?;
    Ok(())
}
