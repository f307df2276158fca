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

/// A quiet fd names the inode it was asked for, even when another file
/// has been renamed over that inode's name meanwhile.
#[test]
fn quiet_fd_follows_the_inode_not_the_name() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("cache");
    std::fs::write(&path, b"first").unwrap();
    let first = File::open(&path).unwrap();
    let other = dir.path().join("other");
    std::fs::write(&other, b"second").unwrap();
    std::fs::rename(&other, &path).unwrap();
    let quiet = lamina_sys::open_quiet(&first).expect("quiet fd");
    assert_eq!(
        quiet.metadata().unwrap().ino(),
        first.metadata().unwrap().ino()
    );
    let mut back = [0u8; 5];
    quiet.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"first");
}

/// A quiet fd's writes raise no pre-content event in a group marking the
/// file; a normal fd's write does (and waits for the answer).
#[test]
fn quiet_fd_writes_raise_no_events() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("sparse");
    File::create(&path).unwrap().set_len(1 << 20).unwrap();
    let group = FanotifyGroup::new().expect("fanotify pre-content group (root, Linux 6.14+)");
    group.watch(&path).expect("pre-content mark");
    let quiet = lamina_sys::open_quiet(&File::open(&path).unwrap()).expect("quiet fd");
    quiet.write_all_at(&[7u8; 4096], 8192).unwrap();
    let mut back = [0u8; 4096];
    quiet.read_exact_at(&mut back, 8192).unwrap();
    assert_eq!(back, [7u8; 4096]);
    let group_fd = group.as_fd();
    let mut fds = [rustix::event::PollFd::new(
        &group_fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 200_000_000,
    };
    assert_eq!(
        rustix::event::poll(&mut fds, Some(&ts)).unwrap(),
        0,
        "quiet I/O raised an event"
    );

    let normal = OpenOptions::new().write(true).open(&path).unwrap();
    let writer = std::thread::spawn(move || normal.write_all_at(&[9u8; 4096], 16384));
    let mut buf = Vec::new();
    let events = group.read_events(&mut buf).unwrap();
    assert!(!events.is_empty(), "a normal write raises an event");
    for ev in events {
        group.respond(ev.response_fd, Response::Allow).unwrap();
    }
    writer.join().unwrap().unwrap();
}

/// Chunk locks exclude other open file descriptions, not the holder's own.
#[test]
fn range_locks_exclude_other_descriptions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    File::create(&path).unwrap().set_len(1 << 20).unwrap();
    // A write lock needs an fd open for writing.
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    };
    let (a, b) = (open(), open());
    assert!(lamina_sys::try_lock_range(&a, 0, 4096).unwrap());
    assert!(
        lamina_sys::try_lock_range(&a, 0, 4096).unwrap(),
        "own lock again"
    );
    assert!(
        !lamina_sys::try_lock_range(&b, 4095, 2).unwrap(),
        "overlapping"
    );
    assert!(
        lamina_sys::try_lock_range(&b, 4096, 4096).unwrap(),
        "next range"
    );
    lamina_sys::unlock_range(&a, 0, 4096).unwrap();
    assert!(lamina_sys::try_lock_range(&b, 0, 4096).unwrap());
}
