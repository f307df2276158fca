//! Pre-content events against the real kernel (needs root and Linux 6.14+).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;

use lamina_sys::{FanotifyGroup, Response, FAN_PRE_ACCESS};

#[test]
fn fill_through_event_fd_then_allow_and_deny() {
    // /var/tmp is on the root filesystem (ext4 here), which accepts pre-content marks.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("sparse");
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .unwrap();
    f.set_len(1 << 20).unwrap();
    drop(f);
    let group = FanotifyGroup::new().expect("fanotify pre-content group (root, Linux 6.14+)");
    group.watch(&path).expect("pre-content mark");

    let reader_path = path.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        File::open(&reader_path)
            .unwrap()
            .read_exact(&mut buf)
            .map(|_| buf)
    });
    let mut buf = Vec::new();
    let events = group.read_events(&mut buf).unwrap();
    assert!(!events.is_empty());
    let ev = &events[0];
    assert_eq!(ev.mask & FAN_PRE_ACCESS, FAN_PRE_ACCESS);
    let (offset, count) = ev.range.expect("range info");
    assert_eq!(offset, 0);
    assert!(count >= 4096, "{count}");
    let file = File::from(ev.file.as_ref().unwrap().try_clone().unwrap());
    file.write_all_at(&vec![0xAB; count as usize], offset)
        .unwrap();
    for e in &events {
        group.respond(e.response_fd, Response::Allow).unwrap();
    }
    let data = reader.join().unwrap().unwrap();
    assert!(data.iter().all(|&b| b == 0xAB));

    // A denied read fails with the errno we chose, and nothing is filled.
    let reader_path = path.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        File::open(&reader_path)
            .unwrap()
            .read_exact_at(&mut buf, 512 * 1024)
    });
    let events = group.read_events(&mut buf).unwrap();
    for e in &events {
        group
            .respond(e.response_fd, Response::DenyErrno(libc::EIO))
            .unwrap();
    }
    let err = reader.join().unwrap().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));

    // Unwatched: reads no longer wait for us.
    group.unwatch(&path).unwrap();
    let mut b = vec![0u8; 16];
    File::open(&path)
        .unwrap()
        .read_exact_at(&mut b, 900 * 1024)
        .unwrap();
}
